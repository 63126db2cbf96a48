"""memsnapctl against a real daemon: human output, -o json/yaml anywhere, job lifecycle, exit codes, errors."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
from pathlib import Path

from tests.helpers import DaemonProc, counter_argv, ticks, token_daemon, wait_for


def _run(d: DaemonProc, jobs_to_kill: list[int], name: str, mib: int = 8) -> dict:
    out = json.loads(d.ctl("run", "--name", name, "--json", "--", *counter_argv(mib, 0.1), check=True).stdout)
    jobs_to_kill.append(out["pid"])
    wait_for(lambda: len(ticks(out["log"], out["pid"])) >= 2, 30, what="the job to tick")
    return out


def _job(d: DaemonProc, key: str) -> dict:
    return next(j for j in json.loads(d.ctl("jobs", "-o", "json", check=True).stdout) if key in (j["id"], j["name"]))


def test_human_output_is_tables_and_one_line_summaries(daemon, jobs_to_kill):
    started = daemon.ctl("run", "--name", "human-out", "--", *counter_argv(8, 0.1), check=True).stdout
    assert re.fullmatch(r"started job-[0-9a-f]+ \(human-out\) as pid \d+; output: memsnapctl logs -f job-\S+\n",
                        started), started
    job = _job(daemon, "human-out")
    jobs_to_kill.append(job["pid"])
    wait_for(lambda: len(ticks(job["log_path"], job["pid"])) >= 2, 30, what="the job to tick")

    table = daemon.ctl("jobs", check=True).stdout.splitlines()
    assert table[0].split() == ["JOB", "NAME", "PID", "STATE", "AGE", "FROM", "COMMAND"]
    row = next(r for r in table if r.startswith(job["id"]))
    assert "human-out" in row and "running" in row and "memsnap-init" not in row
    assert Path(counter_argv()[0]).name in row  # (the program, not memsnap's launcher)
    wide = daemon.ctl("jobs", "-o", "wide", check=True).stdout
    assert str(counter_argv()[1]) in wide and "memsnap-init" not in wide

    ck = daemon.ctl("checkpoint", "human-out", check=True).stdout
    assert re.fullmatch(r"ck-\S+: staged, \d+\.\d MiB, job frozen \d+ ms \(dump [\d.]+ m?s\), in tier\n", ck), ck
    ck_id = ck.split(":")[0]

    lst = daemon.ctl("list", check=True).stdout.splitlines()
    assert lst[0].split() == ["ID", "NAME", "STATE", "JOB/PID", "SIZE", "STORED", "NEW", "WHERE", "AGE"]
    assert any(r.startswith(ck_id) and "human-out" in r and "MiB" in r for r in lst[1:])
    wide = daemon.ctl("list", "-o", "wide", check=True).stdout.splitlines()[0].split()
    assert wide[-2:] == ["FROZEN", "ERROR"]

    show = daemon.ctl("show", ck_id, check=True).stdout
    assert re.search(r"^name +human-out$", show, re.M) and re.search(r"^created +\d{4}-\d\d-\d\d ", show, re.M)

    stopped = daemon.ctl("stop", "human-out", check=True).stdout
    assert re.fullmatch(rf"{job['id']} \(human-out\) stopped in [\d.]+ m?s\n", stopped), stopped

    restored = daemon.ctl("restore", "human-out", check=True).stdout
    m = re.fullmatch(rf"restored {ck_id} as (job-[0-9a-f]+) \(pid (\d+)\) in [\d.]+ m?s \(verify [\d.]+ m?s\)\n",
                     restored)
    assert m, restored
    jobs_to_kill.append(int(m.group(2)))


def test_output_options_anywhere_and_yaml(daemon, jobs_to_kill):
    before = json.loads(daemon.ctl("--json", "status", check=True).stdout)
    for args in (["status", "--json"], ["status", "-o", "json"], ["-ojson", "status"], ["status", "--output=json"]):
        got = json.loads(daemon.ctl(*args, check=True).stdout)
        assert got["version"] == before["version"], args
    y = daemon.ctl("status", "-o", "yaml", check=True).stdout
    assert re.search(r"^criu_version: ", y, re.M) and re.search(r"^tier_capacity_bytes: \d+$", y, re.M)
    # Words after `--` belong to the job, even --json.
    job = json.loads(daemon.ctl("run", "-o", "json", "--", sys.executable, "-c", "import sys; print(sys.argv)",
                                "--json", check=True).stdout)
    jobs_to_kill.append(job["pid"])
    wait_for(lambda: "--json" in Path(job["log"]).read_text(), 10, what="the job's output")


def test_restore_by_name_reports_the_checkpoint_it_chose(daemon, jobs_to_kill):
    job = _run(daemon, jobs_to_kill, "by-name")
    ck = json.loads(daemon.ctl("checkpoint", "by-name", "--stop", "-o", "json", check=True).stdout)
    r = json.loads(daemon.ctl("restore", "by-name", "--json", check=True).stdout)
    jobs_to_kill.append(r["pid"])
    assert r["checkpoint"] == ck["id"] and r["requested"] == "by-name"
    assert _job(daemon, r["job"])["restored_from"] == ck["id"]
    assert job["job"] != r["job"]


def test_stop_ends_a_job_with_sigterm(daemon, jobs_to_kill):
    job = _run(daemon, jobs_to_kill, "to-stop")
    r = json.loads(daemon.ctl("stop", "to-stop", "--json", check=True).stdout)
    assert r["job"] == job["job"] and r["killed"] is False
    assert not Path(f"/proc/{job['pid']}").exists()
    assert _job(daemon, job["job"])["running"] is False


def test_kill_pid_from_the_host_ends_a_run_job(daemon, jobs_to_kill):
    # The pid `run` prints is PID 1 of the job's namespace: its init passes SIGTERM on to the command.
    job = _run(daemon, jobs_to_kill, "kill-pid")
    os.kill(job["pid"], signal.SIGTERM)
    wait_for(lambda: not _job(daemon, job["job"])["running"], 10, what="the job to end on SIGTERM")


def test_kill_ends_a_job_at_once(daemon, jobs_to_kill):
    job = _run(daemon, jobs_to_kill, "to-kill")
    r = json.loads(daemon.ctl("kill", job["job"], "--json", check=True).stdout)
    assert r["killed"] is True
    assert not Path(f"/proc/{job['pid']}").exists()


def test_logs_prints_and_follows_a_jobs_output(daemon, jobs_to_kill):
    job = json.loads(daemon.ctl("run", "--json", "--name", "chatty", "--", sys.executable, "-c",
                                "import time\nfor i in range(4): print('line', i, flush=True); time.sleep(0.3)",
                                check=True).stdout)
    jobs_to_kill.append(job["pid"])
    followed = daemon.ctl("logs", "-f", "chatty", check=True, timeout=60).stdout
    assert followed.splitlines() == [f"line {i}" for i in range(4)]
    assert daemon.ctl("logs", job["job"], check=True).stdout == followed


def test_each_restore_writes_a_log_of_its_own_linked_to_its_parent(daemon, jobs_to_kill):
    job = _run(daemon, jobs_to_kill, "logs-restored")
    ck = json.loads(daemon.ctl("checkpoint", "logs-restored", "--stop", "--json", check=True).stdout)
    before = Path(job["log"]).read_text()
    copies = [json.loads(daemon.ctl("restore", ck["id"], "--json", check=True).stdout) for _ in range(2)]
    jobs_to_kill.extend(c["pid"] for c in copies)
    for c in copies:
        wait_for(lambda c=c: ticks(job["log"], c["pid"]), 20, what="the restored copy to tick")
        out = daemon.ctl("logs", c["job"], check=True).stdout
        head, *lines = out.splitlines()
        assert head == f"# memsnap: restored from {ck['id']}; earlier output: {job['log']}"
        assert lines and all(f" {c['pid']} " in ln for ln in lines), out  # its own ticks, nobody else's
        assert _job(daemon, c["job"])["log_path"] != job["log"]
    assert Path(job["log"]).read_text() == before  # the parent's log stays as it was


def test_rm_refuses_a_running_job_and_forgets_an_ended_one(daemon, jobs_to_kill):
    job = _run(daemon, jobs_to_kill, "to-rm")
    r = daemon.ctl("rm", "to-rm")
    assert r.returncode == 8 and "stop it first" in r.stderr, r.stderr
    daemon.ctl("stop", "to-rm", check=True)
    assert daemon.ctl("rm", "to-rm", check=True).stdout == f"removed {job['job']} (to-rm)\n"
    assert not [j for j in json.loads(daemon.ctl("jobs", "--json", check=True).stdout) if j["id"] == job["job"]]
    assert not Path(job["log"]).exists()


def test_prune_dry_run_lists_and_prune_removes_ended_jobs_and_failed_checkpoints(make_daemon, jobs_to_kill):
    d = make_daemon("prune").start()
    alive = _run(d, jobs_to_kill, "stays")
    gone = _run(d, jobs_to_kill, "ends")
    d.ctl("kill", "ends", check=True)
    failed = d.ctl("checkpoint", str(os.getpid()))  # pytest itself is no session leader in a namespace: refused
    assert failed.returncode != 0
    dry = json.loads(d.ctl("prune", "--dry-run", "--json", check=True).stdout)
    assert dry["jobs"] == [gone["job"]] and dry["dry_run"] is True
    failed_ids = [c["id"] for c in json.loads(d.ctl("list", "--json", check=True).stdout) if c["state"] == "failed"]
    assert sorted(dry["checkpoints"]) == sorted(failed_ids)
    assert json.loads(d.ctl("prune", "--dry-run", "--json", check=True).stdout) == dry  # nothing removed
    human = d.ctl("prune", check=True).stdout
    assert f"removed job {gone['job']} (ends)" in human
    left = [j["id"] for j in json.loads(d.ctl("jobs", "--json", check=True).stdout)]
    assert left == [alive["job"]]
    assert not [c for c in json.loads(d.ctl("list", "--json", check=True).stdout) if c["state"] == "failed"]


def test_exit_code_of_each_error_class(daemon, tmp_path, jobs_to_kill):
    assert daemon.ctl("show", "ck-nope").returncode == 3  # not found
    assert daemon.ctl("checkpoint", "12ab").returncode == 2  # invalid argument
    assert daemon.ctl("checkpoint").returncode == 2  # usage
    assert daemon.ctl("no-such-command").returncode == 2
    job = _run(daemon, jobs_to_kill, "exit-codes")
    daemon.ctl("checkpoint", job["job"], check=True)
    r = daemon.ctl("--socket", str(tmp_path / "none.sock"), "status")
    assert r.returncode == 5 and "no memsnapd socket at" in r.stderr, r.stderr
    r = daemon.ctl("rm", job["job"])  # running: the operation is refused
    assert r.returncode == 8 and "FAILED_PRECONDITION" in r.stderr
    stopped = json.loads(daemon.ctl("checkpoint", job["job"], "--stop", "--json", check=True).stdout)
    pages = next((daemon.tier / stopped["id"]).glob("pages-*"))
    with open(pages, "r+b") as f:
        f.seek(4096)
        b = f.read(1)
        f.seek(4096)
        f.write(bytes([b[0] ^ 0xFF]))
    r = daemon.ctl("restore", stopped["id"])
    assert r.returncode == 6 and "DATA_LOSS" in r.stderr, r.stderr


def test_exit_code_of_a_full_tier(make_daemon, jobs_to_kill, tmp_path):
    mnt = tmp_path / "small-tier"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        d = make_daemon("small", tier=mnt).start()
        job = _run(d, jobs_to_kill, "too-big", mib=64)
        r = d.ctl("checkpoint", job["job"])
        assert r.returncode == 7 and "RESOURCE_EXHAUSTED" in r.stderr, r.stderr
    finally:
        d.stop()
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_errors_in_json_mode_are_json(daemon):
    r = daemon.ctl("show", "ck-nope", "-o", "json")
    err = json.loads(r.stderr)
    assert err["error"]["code"] == "NOT_FOUND" and "ck-nope" in err["error"]["message"] and r.returncode == 3
    r = daemon.ctl("--json", "checkpoint")
    assert json.loads(r.stderr)["error"]["code"] == "USAGE" and r.returncode == 2


def test_run_of_a_missing_command_says_why_and_starts_nothing(daemon):
    before = json.loads(daemon.ctl("jobs", "--json", check=True).stdout)
    r = daemon.ctl("run", "--", "/nonexistent/cmd")
    assert r.returncode == 3 and "/nonexistent/cmd: no such file" in r.stderr, r.stderr
    assert json.loads(daemon.ctl("jobs", "--json", check=True).stdout) == before


def test_version_names_memsnap_criu_and_kernel(daemon):
    out = daemon.ctl("--version", check=True).stdout
    assert re.search(r"^memsnap \d+\.\d+", out, re.M) and re.search(r"^CRIU 4\.", out, re.M)
    assert f"kernel {os.uname().release}" in out


def test_a_restore_that_fails_on_a_changed_file_shows_criu_s_cause(daemon, jobs_to_kill, tmp_path):
    # The job writes a file of its own (not O_APPEND, so CRIU records its size); it grows after the
    # checkpoint, and CRIU refuses to restore it: the message must say that, not "Unable to open fd".
    out = tmp_path / "out.txt"
    code = f"import time\nf = open({str(out)!r}, 'w')\nwhile True:\n    f.write('x\\n'); f.flush(); time.sleep(0.1)"
    job = json.loads(daemon.ctl("run", "--json", "--name", "changed-file", "--", sys.executable, "-c", code,
                                check=True).stdout)
    jobs_to_kill.append(job["pid"])
    wait_for(lambda: out.exists() and out.stat().st_size > 2, 10, what="the job to write")
    ck = json.loads(daemon.ctl("checkpoint", "changed-file", "--json", check=True).stdout)
    size = out.stat().st_size
    wait_for(lambda: out.stat().st_size > size + 4, 10, what="the file to grow after the checkpoint")
    daemon.ctl("stop", "changed-file", check=True)
    r = daemon.ctl("restore", ck["id"])
    assert r.returncode == 8 and "FAILED_PRECONDITION" in r.stderr, r.stderr
    cause = r.stderr.split(f"restore of {ck['id']} failed: ")[1]
    assert "bad size" in cause.split(";")[0], r.stderr  # the decisive line first, not "Unable to open fd"
    assert "hint: " in r.stderr and "/restore.log" in r.stderr


def test_watch_calls_a_failed_dump_failed(make_daemon, jobs_to_kill, tmp_path):
    d = make_daemon("watch-failed").start()
    # CRIU refuses deleted files bigger than its ghost limit (1 MiB): a real, deterministic dump failure.
    ghost = tmp_path / "ghost.bin"
    code = (f"import os, time\nf = open({str(ghost)!r}, 'wb+'); f.write(os.urandom(4 << 20)); f.flush()\n"
            f"os.unlink({str(ghost)!r})\nprint('ready', flush=True)\nwhile True: time.sleep(0.1)")
    job = json.loads(d.ctl("--json", "run", "--", sys.executable, "-c", code, check=True).stdout)
    jobs_to_kill.append(int(job["pid"]))
    wait_for(lambda: "ready" in Path(job["log"]).read_text(), 20, what="the ghost job to start")
    r = d.ctl("checkpoint", job["job"])
    assert r.returncode != 0
    failed = next(c for c in json.loads(d.ctl("list", "--json", check=True).stdout) if c["state"] == "failed")
    w = d.ctl("watch", failed["id"])
    assert w.returncode == 8 and "failed" in w.stdout and "retry" not in w.stdout + w.stderr, w.stdout + w.stderr


def test_memsnapd_version_names_memsnap_criu_and_kernel():
    out = subprocess.run([sys.executable, "-m", "memsnap.daemon", "--version"], capture_output=True, text=True,
                         check=True).stdout
    assert re.search(r"^memsnap \d+\.\d+", out, re.M) and re.search(r"^CRIU 4\.", out, re.M)
    assert f"kernel {os.uname().release}" in out


def test_refused_requests_are_logged_by_the_daemon(daemon):
    assert daemon.ctl("show", "ck-refused-here").returncode == 3
    wait_for(lambda: "GetCheckpoint refused: no checkpoint 'ck-refused-here'" in daemon.log.read_text(), 5,
             what="the refusal in the daemon's log")


def test_delete_and_evict_are_logged_by_the_daemon(daemon, jobs_to_kill):
    _run(daemon, jobs_to_kill, "logged")
    ck = json.loads(daemon.ctl("checkpoint", "logged", "--stop", "--wait", "durable", "--json", check=True).stdout)
    daemon.ctl("evict", ck["id"], check=True)
    daemon.ctl("delete", ck["id"], check=True)
    log = daemon.log.read_text()
    assert f"ckpt={ck['id']} tier copy evicted" in log and f"ckpt={ck['id']} checkpoint deleted" in log


def test_restore_from_the_store_shows_the_fetch_and_restore_progress(make_daemon, jobs_to_kill):
    # slow-fetch holds the restore 3 s once the stored copy is fetched, slow-restore 3 s before CRIU runs: the CLI
    # polls Status(op_id) meanwhile and shows what the daemon reports (bytes of the fetch, then the phase).
    d = make_daemon("progress", env={"MEMSNAP_FAILPOINTS": "slow-fetch,slow-restore"}).start()
    _run(d, jobs_to_kill, "fetched", mib=32)
    ck = json.loads(d.ctl("checkpoint", "fetched", "--stop", "--wait", "durable", "--json", check=True).stdout)
    d.ctl("evict", ck["id"], check=True)
    size = ck["size_bytes"]

    # Not a terminal: plain lines on stderr, no carriage returns; the result line on stdout as before.
    r = d.ctl("restore", ck["id"], check=True)
    jobs_to_kill.append(int(re.search(r"\(pid (\d+)\)", r.stdout).group(1)))
    assert r.stdout.startswith(f"restored {ck['id']} as job-") and "fetched from the store" in r.stdout, r.stdout
    assert "\r" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    fetch = [ln for ln in lines if ln.startswith(f"restoring {ck['id']} [") and ln.endswith(" fetch")]
    assert fetch and "100.0%" in fetch[-1], r.stderr
    assert any(ln.startswith(f"restoring {ck['id']}: restore (") for ln in lines), r.stderr
    d.ctl("stop", "fetched", check=False)

    # -o json: stdout is the one result object; stderr streams one object per update.
    d.ctl("evict", ck["id"], check=True)
    r = d.ctl("--json", "restore", ck["id"], check=True)
    out = json.loads(r.stdout)
    jobs_to_kill.append(out["pid"])
    assert out["from_store"] is True and out["checkpoint"] == ck["id"]
    updates = [json.loads(ln) for ln in r.stderr.splitlines()]
    assert {u["progress"] for u in updates} == {f"restoring {ck['id']}"}, updates
    fetched = [u for u in updates if u["phase"] == "fetch"]
    assert fetched and fetched[-1]["done_bytes"] == fetched[-1]["total_bytes"] == size, updates
    assert updates[-1]["phase"] == "restore"


def _pair(base: Path, **target_kw) -> tuple[DaemonProc, DaemonProc]:
    token = base / "token"
    token.write_text(secrets.token_hex(32))
    a = token_daemon(base / "a", token).start()
    try:
        b = token_daemon(base / "b", token, **target_kw).start()
    except BaseException:
        a.cleanup()
        raise
    return a, b


def test_a_moved_job_is_the_targets_own_found_by_its_name_with_a_local_log(tmp_path, jobs_to_kill):
    a, b = _pair(tmp_path)
    try:
        job = _run(a, jobs_to_kill, "traveller")
        r = a.ctl("--json", "migrate", "traveller", "--to", b.address, check=True)
        out = json.loads(r.stdout)
        jobs_to_kill.append(out["target_pid"])
        row = _job(b, "traveller")  # the name stays; the id is the target's own, and says where it came from
        assert row["id"] == out["target_job"] != job["job"] and row["pid"] == out["target_pid"]
        host = json.loads(a.ctl("--json", "status", check=True).stdout)["hostname"]
        assert row["moved_from"] == f"{host}/{job['job']}"
        log = Path(row["log_path"])
        assert log.parent == b.state / "jobs" and log.stat().st_uid == 0, row
        first = log.read_text().splitlines()[0]
        assert first == f"# memsnap: moved here from {host}/{job['job']} ({out['checkpoint']}); earlier output: " \
                        f"{job['log']}", first
        wait_for(lambda: len(ticks(log, out["target_pid"])) >= 2, 30, what="the moved job to tick into its own log")
        assert f" {out['target_pid']} " not in Path(job["log"]).read_text()  # nothing written into the source's
        logs = b.ctl("logs", "traveller", check=True).stdout
        assert f" {out['target_pid']} " in logs and "moved here from" in logs
        table_out = b.ctl("jobs", check=True).stdout
        assert f"{host}/{job['job']}" in table_out
    finally:
        a.cleanup()
        b.cleanup()


def test_migrate_shows_its_progress_while_it_runs(tmp_path, jobs_to_kill):
    # slow-restore holds the target's restore 3 s: the CLI polls Status(op_id) on the source meanwhile.
    a, b = _pair(tmp_path, env={"MEMSNAP_FAILPOINTS": "slow-restore"})
    try:
        _run(a, jobs_to_kill, "json-mover", mib=32)
        r = a.ctl("--json", "migrate", "json-mover", "--to", b.address, check=True)
        out = json.loads(r.stdout)  # stdout: the one result object
        jobs_to_kill.append(out["target_pid"])
        updates = [json.loads(ln) for ln in r.stderr.splitlines()]  # stderr: one object per update
        assert {u["progress"] for u in updates} == {f"moving json-mover to {b.address}"}, updates
        assert "restore on the target" in [u["phase"] for u in updates], updates
        sent = [u for u in updates if u.get("total_bytes")]
        assert all(u["phase"] in ("dump+transfer", "transfer") and u["done_bytes"] <= out["bytes_sent"] for u in sent)

        _run(a, jobs_to_kill, "plain-mover", mib=32)
        r = a.ctl("migrate", "plain-mover", "--to", b.address, check=True)
        jobs_to_kill.append(int(re.search(r" pid (\d+),", r.stdout).group(1)))
        assert "\r" not in r.stderr
        assert f"moving plain-mover to {b.address}: restore on the target (" in r.stderr, r.stderr
    finally:
        a.cleanup()
        b.cleanup()
