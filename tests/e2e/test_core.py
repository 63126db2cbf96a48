"""Core loop with real CRIU: run, checkpoint, restore, bad input, peer authorization."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import psutil
import pytest

from memsnap.client import ClientError
from tests.helpers import REPO, DaemonProc, counter_argv, start_digest, ticks, wait_for


def _run_counter(d: DaemonProc, jobs_to_kill: list[int], mib: int = 32, name: str = "") -> dict:
    with d.client() as c:
        job = c.run(counter_argv(mib), name=name)
    jobs_to_kill.append(int(job.pid))
    wait_for(lambda: len(ticks(job.log_path)) >= 3, 30, what="the job to tick")
    return {"id": job.id, "pid": int(job.pid), "log": job.log_path}


def test_roundtrip_checkpoint_keeps_running_stop_ends_restore_resumes_next_tick(daemon, jobs_to_kill):
    job = _run_counter(daemon, jobs_to_kill, mib=64, name="roundtrip")
    digest0 = start_digest(job["log"])

    # A plain checkpoint leaves the job ticking.
    r = daemon.ctl("--json", "checkpoint", str(job["pid"]), check=True)
    first = json.loads(r.stdout)
    assert first["state"] == "staged" and first["in_tier"] and first["id"]
    n = len(ticks(job["log"], job["pid"]))
    wait_for(lambda: len(ticks(job["log"], job["pid"])) >= n + 3, 10, what="ticks after a plain checkpoint")

    # --stop ends the job once the image is staged.
    r = daemon.ctl("--json", "checkpoint", job["id"], "--stop", check=True)
    ck = json.loads(r.stdout)
    assert ck["state"] == "staged" and ck["size_bytes"] > 64 << 20
    wait_for(lambda: not Path(f"/proc/{job['pid']}").exists(), 10, what="the stopped job to be gone")
    last = ticks(job["log"], job["pid"])[-1]
    time.sleep(0.3)
    assert ticks(job["log"], job["pid"])[-1] == last, "the stopped job printed after --stop"

    # Restore resumes at the *next* tick with the same memory digest.
    r = daemon.ctl("--json", "restore", ck["id"], check=True)
    pid = json.loads(r.stdout)["pid"]
    jobs_to_kill.append(pid)
    assert pid != job["pid"]
    wait_for(lambda: len(ticks(job["log"], pid)) >= 3, 20, what="the restored job to tick")
    resumed = ticks(job["log"], pid)
    assert resumed[0].n == last.n + 1
    assert [t.n for t in resumed[:3]] == [last.n + 1, last.n + 2, last.n + 3]
    assert all(t.digest == digest0 for t in resumed)

    # The catalog shows both checkpoints; show has the documented fields.
    shown = json.loads(daemon.ctl("--json", "show", ck["id"], check=True).stdout)
    for key in ("state", "in_tier", "drained_bytes", "last_error", "frozen_ms", "size_bytes"):
        assert key in shown
    ids = [c["id"] for c in json.loads(daemon.ctl("--json", "list", check=True).stdout)]
    assert first["id"] in ids and ck["id"] in ids


def test_concurrent_restores_give_two_live_copies(daemon, jobs_to_kill):
    job = _run_counter(daemon, jobs_to_kill, mib=16, name="twins")
    digest0 = start_digest(job["log"])
    ck = json.loads(daemon.ctl("--json", "checkpoint", job["id"], "--stop", check=True).stdout)
    last = ticks(job["log"], job["pid"])[-1].n

    procs = [subprocess.Popen([sys.executable, "-m", "memsnap.cli", "--json", "restore", ck["id"]],
                              env={**os.environ, "PYTHONPATH": str(REPO), "MEMSNAP_SOCKET": daemon.socket},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    pids = [json.loads(o[0])["pid"] for o in outs]
    jobs_to_kill.extend(pids)
    assert len(set(pids)) == 2
    for pid in pids:
        wait_for(lambda pid=pid: len(ticks(job["log"], pid)) >= 3, 20, what=f"copy {pid} to tick")
        copy = ticks(job["log"], pid)
        assert copy[0].n == last + 1 and all(t.digest == digest0 for t in copy)
        assert Path(f"/proc/{pid}").exists()


def test_bad_input_gets_clear_errors_and_loses_nothing(daemon, jobs_to_kill):
    job = _run_counter(daemon, jobs_to_kill, mib=8, name="bystander")
    with daemon.client() as c:
        with pytest.raises(ClientError) as e:
            c.checkpoint(999_999)
        assert e.value.code == grpc.StatusCode.NOT_FOUND and "999999" in e.value.message
        with pytest.raises(ClientError) as e:
            c.checkpoint("12ab")
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(ClientError) as e:
            c.restore("ck-does-not-exist")
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        with pytest.raises(ClientError) as e:
            c.show("ck-does-not-exist")
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        assert c.status().version  # still up
    # The CLI prints one line and exits non-zero.
    r = daemon.ctl("checkpoint", "not-a-pid")
    assert r.returncode != 0 and r.stderr.count("\n") == 1 and "INVALID_ARGUMENT" in r.stderr
    n = len(ticks(job["log"], job["pid"]))
    wait_for(lambda: len(ticks(job["log"], job["pid"])) > n + 2, 10, what="the bystander to keep ticking")


def test_tier_too_small_is_refused_and_job_untouched(make_daemon, jobs_to_kill, tmp_path):
    mnt = tmp_path / "small-tier"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        d = make_daemon("small", tier=mnt).start()
        job = _run_counter(d, jobs_to_kill, mib=64)
        with d.client() as c:
            with pytest.raises(ClientError) as e:
                c.checkpoint(job["pid"], stop=True)
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "MiB free" in e.value.message
            assert c.status().version
        n = len(ticks(job["log"], job["pid"]))
        wait_for(lambda: len(ticks(job["log"], job["pid"])) > n + 2, 10, what="the job to keep ticking")
        leftovers = [p for p in mnt.rglob("*") if p.is_file()]
        assert leftovers == [], f"partial image left in the tier: {leftovers}"
        d.cleanup()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_failed_dump_leaves_process_running_and_no_image(daemon, jobs_to_kill, tmp_path):
    # CRIU refuses deleted files bigger than its ghost limit (1 MiB): a real, deterministic dump failure.
    script = tmp_path / "ghost.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time
        f = open({str(tmp_path / 'ghost.bin')!r}, 'wb+'); f.write(os.urandom(4 << 20)); f.flush()
        os.unlink(f.name)
        n = 0
        while True:
            n += 1; print(f"tick {{n}} {{os.readlink('/proc/self')}} 00", flush=True); time.sleep(0.1)
    """))
    with daemon.client() as c:
        job = c.run([sys.executable, str(script)])
        jobs_to_kill.append(int(job.pid))
        wait_for(lambda: len(ticks(job.log_path)) >= 2, 20, what="ghost job to tick")
        with pytest.raises(ClientError) as e:
            c.checkpoint(job.pid, stop=True)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "left running" in e.value.message and "ghost" in e.value.message.lower()
        failed = [k for k in c.list() if k.job == job.id]
        assert failed and failed[-1].state == 5  # FAILED, reason kept
        assert failed[-1].last_error
        with pytest.raises(ClientError) as e2:
            c.restore(failed[-1].id)
        assert e2.value.code == grpc.StatusCode.FAILED_PRECONDITION
    n = len(ticks(job.log_path))
    wait_for(lambda: len(ticks(job.log_path)) > n + 2, 10, what="the job to keep running after a failed dump")
    assert not (daemon.tier / failed[-1].id).exists()
    assert list((daemon.tier / ".staging").iterdir()) == []


_AS_NOBODY = textwrap.dedent("""
    import json, os, sys
    from memsnap.client import MemsnapClient, ClientError
    c = MemsnapClient(socket=sys.argv[1])   # imports and channel set up as root...
    os.setgroups([]); os.setgid(65534); os.setuid(65534)  # ...the connection is made as nobody
    out = {}
    for name, call in [("checkpoint_root", lambda: c.checkpoint(int(sys.argv[2]))),
                       ("show_root", lambda: c.show(sys.argv[3])),
                       ("checkpoint_own", lambda: c.checkpoint(int(sys.argv[4])).state),
                       ("run_own", lambda: int(c.run(["/bin/sleep", "60"]).pid))]:
        try:
            out[name] = ["OK", call()]
        except ClientError as e:
            out[name] = [e.code.name, e.message]
    print(json.dumps(out, default=str))
""")


def test_peer_credentials_non_root_cannot_touch_roots_process(make_daemon, jobs_to_kill, tmp_path, open_tmp):
    cfg = tmp_path / "open.toml"
    cfg.write_text('[daemon]\nsocket_mode = "0666"\n')
    # nobody must reach the socket (0755 dir); the daemon's peer check is what stops it
    d = make_daemon("auth", extra=["--config", str(cfg)], socket_path=str(open_tmp / "d.sock")).start()
    assert oct(os.stat(d.socket).st_mode & 0o777) == "0o666"
    root_job = _run_counter(d, jobs_to_kill, mib=4)
    root_ck = json.loads(d.ctl("--json", "checkpoint", str(root_job["pid"]), check=True).stdout)
    # A process of nobody's own, started without memsnap.
    own = subprocess.Popen(["/usr/bin/python3", "-c", "import time\nwhile True: time.sleep(0.1)"],
                           user=65534, group=65534, extra_groups=[], start_new_session=True, cwd="/")
    jobs_to_kill.append(own.pid)
    time.sleep(0.3)
    r = subprocess.run([sys.executable, "-c", _AS_NOBODY, d.socket, str(root_job["pid"]), root_ck["id"],
                        str(own.pid)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["checkpoint_root"][0] == "PERMISSION_DENIED", out
    assert out["show_root"][0] == "PERMISSION_DENIED", out
    # nobody's own job runs as nobody (in its own PID namespace), not as root.
    assert out["run_own"][0] == "OK", out
    jobs_to_kill.append(int(out["run_own"][1]))
    assert psutil.Process(int(out["run_own"][1])).uids().real == 65534
    # Authorization lets nobody act on its own process. Whether CRIU can then dump another uid's
    # process needs CAP_SYS_RESOURCE (prlimit), which some sandboxes (this CI VM) withhold from root.
    if _has_cap(24):  # CAP_SYS_RESOURCE
        assert out["checkpoint_own"][0] == "OK", out
    else:
        assert out["checkpoint_own"][0] == "FAILED_PRECONDITION" and "rlimit" in out["checkpoint_own"][1], out


def _has_cap(bit: int) -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> bit & 1)
    return False


def test_default_socket_mode_is_0660(daemon):
    assert os.stat(daemon.socket).st_mode & 0o777 == 0o660
    assert (daemon.state.stat().st_mode & 0o777) == 0o711  # traversable, for job logs; not listable


def test_health_service_and_reflection_are_served(daemon):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(f"unix:{daemon.socket}") as ch:
        h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="memsnap.v1.Memsnap"),
                                                 timeout=5)
        assert h.status == health_pb2.HealthCheckResponse.SERVING
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        resp = next(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(iter([req]), timeout=5))
        names = {s.name for s in resp.list_services_response.service}
        assert {"memsnap.v1.Memsnap", "grpc.health.v1.Health"} <= names


def test_status_reports_versions_tier_and_counts(daemon):
    s = json.loads(daemon.ctl("--json", "status", check=True).stdout)
    assert s["version"] and s["criu_version"].startswith("4.")
    assert s["tier_capacity_bytes"] > 0 and s["tier_free_bytes"] > 0 and "tier_used_bytes" in s
    assert "checkpoints_by_state" in s and "jobs_running" in s
    human = daemon.ctl("status", check=True).stdout
    assert "CRIU 4." in human and "free of" in human


def test_a_job_in_a_nested_user_namespace_is_refused_in_one_line_and_runs_on(daemon, jobs_to_kill):
    # CRIU cannot dump a nested user namespace: the error says so, the job runs on, nothing is left behind.
    with daemon.client() as c:
        job = c.run(["unshare", "--user", "--map-root-user", sys.executable, "-c",
                     "import time\nwhile True: print('alive', flush=True); time.sleep(0.1)"])
    jobs_to_kill.append(int(job.pid))
    wait_for(lambda: "alive" in Path(job.log_path).read_text(), 20, what="the job to run")
    r = daemon.ctl("checkpoint", job.id)
    assert r.returncode != 0 and "user namespace of its own" in r.stderr, r.stderr
    assert r.stderr.strip().count("\n") == 0
    n = Path(job.log_path).read_text().count("alive")
    wait_for(lambda: Path(job.log_path).read_text().count("alive") > n + 3, 10, what="the job to run on")
    listed = json.loads(daemon.ctl("--json", "list", "--job", job.id, check=True).stdout)
    assert all(c["state"] == "failed" for c in listed) and not (daemon.tier / listed[0]["id"]).exists()
