"""The memory guard for real: per-job v1 memory cgroups, real memory growth, real CRIU, real PSI.

A job at its memory limit is parked (checkpointed and stopped), never OOM killed, and resumes with a larger
limit at the next tick; under node memory pressure (a real hog thrashing its page cache inside a small
cgroup of its own) the lowest-priority job is parked first, a critical one never, and auto-resume brings
them back once the hog is gone; observe mode parks nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import NOBODY, DaemonProc, counter_argv, guard_table, start_digest, ticks, wait_for

V1 = Path("/sys/fs/cgroup/memory")
pytestmark = pytest.mark.skipif(not (V1 / "memory.oom_control").exists(),
                                reason="needs the cgroup v1 memory controller (this test node has it)")
M = 1 << 20
TRIALS = int(os.environ.get("MEMSNAP_GUARD_TRIALS", "10"))


def guard_jobs(d: DaemonProc) -> dict[str, Any]:
    return guard_table(d.state)


def job_row(d: DaemonProc, job_id: str, patient: bool = False) -> dict[str, Any] | None:
    """The job's row in `memsnapctl jobs`. patient (a poll): a call that runs out of time warns, with the daemon's
    stacks in pytest's warnings summary, and gives None (one slow poll, seen once in CI during a park, is not
    what these tests check)."""
    r = d.ctl("--json", "jobs", check=not patient)
    if r.returncode != 0 and "DEADLINE_EXCEEDED" in r.stderr:
        warnings.warn(f"memsnapctl jobs ran out of time while polling {job_id}" + d.stacks_if_stuck(r.stderr),
                      stacklevel=2)
        return None
    assert r.returncode == 0, r.stderr
    return next((x for x in json.loads(r.stdout) if x["id"] == job_id), None)


def oom_control(cgroup: str) -> dict[str, int]:
    return {k: int(v) for k, v in (ln.split() for ln in Path(cgroup, "memory.oom_control").read_text().splitlines())}


def memory_cgroup_of(pid: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, ctrl, path = line.split(":", 2)
        if ctrl == "memory":
            return path
    return ""


def run_job(d: DaemonProc, *args: str, argv: list[str]) -> dict[str, Any]:
    r = d.ctl("--json", "run", *args, "--", *argv, check=True)
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def wait_state(d: DaemonProc, job_id: str, state: str, timeout: float = 60) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        row = job_row(d, job_id, patient=True)
        return row if row is not None and row.get("guard_state") == state else None
    got: dict[str, Any] = wait_for(check, timeout, 0.1, f"{job_id} to be {state}")  # type: ignore[assignment]
    return got


def assert_continues(log: str, old_pid: int, new_pid: int) -> None:
    """The resumed copy's first tick follows the parked one's last, with the same memory digest."""
    before = ticks(log, old_pid)
    after: list[Any] = wait_for(lambda: ticks(log, new_pid), 30, 0.05, "the resumed job to tick")  # type: ignore[assignment]
    assert after[0].n == before[-1].n + 1, (before[-1], after[0])
    assert after[0].digest == before[-1].digest == start_digest(log)


def write_config(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_job_at_its_memory_limit_is_parked_not_killed_and_resumes_with_a_new_limit(
        daemon: DaemonProc, jobs_to_kill: list[int]) -> None:
    """TRIALS times: a job allocating 32 MiB every 0.2 s under --memory-limit 256M is parked at the limit
    (the kernel's oom_kill counter for its cgroup stays 0), and `resume --memory-limit 1G` continues at the
    next tick with the same digest, in its cgroup with the new limit."""
    for trial in range(TRIALS):
        job = run_job(daemon, "--memory-limit", "256M", "--name", f"grow{trial}",
                      argv=counter_argv(16, 0.2, "--grow-mib", "32", "--grow-max-mib", "480"))
        jobs_to_kill.append(job["pid"])
        g = guard_jobs(daemon)[job["job"]]
        cgroup = g["cgroup"]
        assert memory_cgroup_of(job["pid"]) == "/" + str(Path(cgroup).relative_to(V1))
        assert oom_control(cgroup)["oom_kill_disable"] == 1
        kills_before = oom_control(cgroup).get("oom_kill", 0)

        row = wait_state(daemon, job["job"], "parked")
        assert "memory limit" in row["parked_reason"] and not row["running"]
        assert oom_control(cgroup).get("oom_kill", 0) == kills_before == 0
        stats = guard_jobs(daemon)[job["job"]]["stats"]
        # dumping at the limit: the job was waiting at its limit when the park began
        assert stats["at_limit_at_trigger"] is True and stats["usage_at_trigger"] >= 250 * M
        assert stats["headroom_limit"] > 256 * M
        ck = json.loads(daemon.ctl("--json", "show", row["parked_checkpoint"], check=True).stdout)
        assert ck.get("parked_reason") == row["parked_reason"], ck
        log = job["log"]
        assert ticks(log, job["pid"]) and "Killed" not in Path(log).read_text()

        r = daemon.ctl("--json", "resume", job["job"], "--memory-limit", "1G", check=True)
        resumed = json.loads(r.stdout)
        jobs_to_kill.append(resumed["pid"])
        assert_continues(log, job["pid"], resumed["pid"])
        assert memory_cgroup_of(resumed["pid"]) == "/" + str(Path(cgroup).relative_to(V1))
        assert int(Path(cgroup, "memory.limit_in_bytes").read_text()) == 1 << 30
        assert oom_control(cgroup).get("oom_kill", 0) == 0
        assert job_row(daemon, job["job"])["guard_state"] == "resumed"  # type: ignore[index]
        os.kill(resumed["pid"], signal.SIGKILL)


def test_observe_mode_parks_nothing(make_daemon: Any, tmp_path: Path, jobs_to_kill: list[int]) -> None:
    cfg = write_config(tmp_path / "observe.toml", '[guard]\nmode = "observe"\n')
    d = make_daemon("observe", extra=["--config", cfg]).start()
    assert "observe" in d.ctl("status", check=True).stdout
    job = run_job(d, "--memory-limit", "96M", argv=counter_argv(8, 0.2, "--grow-mib", "32"))
    jobs_to_kill.append(job["pid"])
    cgroup = guard_jobs(d)[job["job"]]["cgroup"]
    wait_for(lambda: "observe mode: would park " + job["job"] in d.log.read_text(), 30, 0.1, "observe log line")
    time.sleep(1.0)
    row = job_row(d, job["job"])
    assert row is not None and row["running"] and row["guard_state"] == "running"
    assert oom_control(cgroup)["under_oom"] == 1  # it waits at its limit; nobody parked or killed it
    assert json.loads(d.ctl("--json", "list", check=True).stdout) == []


def test_on_limit_kill_ends_the_job_at_its_limit(daemon: DaemonProc, jobs_to_kill: list[int]) -> None:
    job = run_job(daemon, "--memory-limit", "96M", "--on-limit", "kill",
                  argv=counter_argv(8, 0.2, "--grow-mib", "32"))
    jobs_to_kill.append(job["pid"])
    row = wait_state(daemon, job["job"], "killed")
    assert not row["running"] and not row["parked_checkpoint"]


def test_parked_checkpoint_restored_plainly_runs_on_and_is_guarded_again(
        daemon: DaemonProc, jobs_to_kill: list[int]) -> None:
    job = run_job(daemon, "--memory-limit", "96M",
                  argv=counter_argv(16, 0.2, "--grow-mib", "32", "--grow-max-mib", "96"))
    jobs_to_kill.append(job["pid"])
    row = wait_state(daemon, job["job"], "parked")
    cgroup = guard_jobs(daemon)[job["job"]]["cgroup"]
    Path(cgroup, "memory.limit_in_bytes").write_text(str(512 * M))  # room for it, as an admin would give
    r = json.loads(daemon.ctl("--json", "restore", row["parked_checkpoint"], check=True).stdout)
    jobs_to_kill.append(r["pid"])
    assert_continues(job["log"], job["pid"], r["pid"])  # dumped stopped, yet it runs on: the manifest says parked
    wait_for(lambda: guard_jobs(daemon)[job["job"]]["resumed_as"] == r["job"], 30, 0.1, "the guard to adopt it")
    assert guard_jobs(daemon)[r["job"]]["cgroup"] == cgroup
    assert memory_cgroup_of(r["pid"]) == "/" + str(Path(cgroup).relative_to(V1))


def _parked_into_spill(make_daemon: Any, tmp_path: Path, jobs_to_kill: list[int], name: str, more_cfg: str = ""
                       ) -> tuple[DaemonProc, dict[str, Any], dict[str, Any]]:
    """A daemon with guard.spill_dir = tmp_path/spill-tier, and a job it parked there at its 128M limit: (daemon, the
    job as run_job gave it, its guard row once parked)."""
    cfg = write_config(tmp_path / "spill.toml", f'[guard]\nspill_dir = "{tmp_path / "spill-tier"}"\n{more_cfg}')
    d = make_daemon(name, extra=["--config", cfg]).start()
    job = run_job(d, "--memory-limit", "128M", argv=counter_argv(16, 0.2, "--grow-mib", "32", "--grow-max-mib", "192"))
    jobs_to_kill.append(job["pid"])
    return d, job, wait_state(d, job["job"], "parked")


def test_spill_dir_takes_the_park_image_instead_of_the_memory_tier(
        make_daemon: Any, tmp_path: Path, jobs_to_kill: list[int]) -> None:
    d, job, row = _parked_into_spill(make_daemon, tmp_path, jobs_to_kill, "spill")
    image = tmp_path / "spill-tier" / row["parked_checkpoint"]
    assert image.is_dir() and sum(f.stat().st_size for f in image.iterdir()) > 128 * M * 3 // 4
    assert json.loads(d.ctl("--json", "status", check=True).stdout)["tier_used_bytes"] == 0
    # drained to the store like any checkpoint; a spill dir on disk costs no RAM, so its copy stays
    wait_durable(d, row["parked_checkpoint"])
    assert image.is_dir()
    r = d.ctl("--json", "resume", job["job"], "--memory-limit", "64M")
    assert r.returncode != 0 and "cannot hold it" in r.stderr  # a limit below the image is refused up front
    resumed = json.loads(d.ctl("--json", "resume", job["job"], "--memory-limit", "512M", check=True).stdout)
    jobs_to_kill.append(resumed["pid"])
    assert resumed["from_store"] is False
    assert_continues(job["log"], job["pid"], resumed["pid"])
    d.ctl("delete", row["parked_checkpoint"], check=True)
    assert not image.exists()  # delete removes the spill copy too


def test_a_restore_of_a_parked_job_finds_its_image_in_the_spill_dir_and_counts_as_its_resume(
        make_daemon: Any, tmp_path: Path, jobs_to_kill: list[int]) -> None:
    """`memsnapctl restore JOB` of a job parked into guard.spill_dir (its cgroup given room, as an admin would),
    before its image is durable: restored from the spill copy (it answered 'no tier copy and no stored copy; it is
    lost'), at the next tick, the parked row resumed as the new job, which is guarded in the same cgroup."""
    d, job, row = _parked_into_spill(make_daemon, tmp_path, jobs_to_kill, "spill-restore",
                                     '[drain]\nbandwidth = "1M"\n')
    ck = json.loads(d.ctl("--json", "show", row["parked_checkpoint"], check=True).stdout)
    assert ck["state"] != "durable"  # (the drain is capped at 1 MB/s: only the spill copy exists)
    cgroup = guard_jobs(d)[job["job"]]["cgroup"]
    Path(cgroup, "memory.limit_in_bytes").write_text(str(512 * M))
    r = json.loads(d.ctl("--json", "restore", job["job"], check=True).stdout)
    jobs_to_kill.append(r["pid"])
    assert r["from_store"] is False
    assert_continues(job["log"], job["pid"], r["pid"])
    wait_for(lambda: guard_jobs(d)[job["job"]]["resumed_as"] == r["job"], 30, 0.1, "the guard to adopt it")
    g = guard_jobs(d)
    assert g[job["job"]]["state"] == "resumed" and g[r["job"]]["cgroup"] == cgroup


def wait_durable(d: DaemonProc, ckpt_id: str) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        ck: dict[str, Any] = json.loads(d.ctl("--json", "show", ckpt_id, check=True).stdout)
        return ck if ck["state"] == "durable" else None
    got: dict[str, Any] = wait_for(check, 120, 0.2, f"{ckpt_id} to be durable")  # type: ignore[assignment]
    return got


def test_spill_dir_in_ram_is_drained_and_its_copy_evicted_once_durable(
        make_daemon: Any, tmp_path: Path, jobs_to_kill: list[int]) -> None:
    """A spill dir on tmpfs is RAM: the park image is drained to the store, its spill copy is dropped once durable,
    and the resume fetches it from the store and continues at the next tick."""
    spill = Path(f"/dev/shm/memsnap-test-spill-{os.getpid()}")
    cfg = write_config(tmp_path / "spill.toml", f'[guard]\nspill_dir = "{spill}"\n')
    d = make_daemon("spillram", extra=["--config", cfg]).start()
    try:
        job = run_job(d, "--memory-limit", "128M",
                      argv=counter_argv(16, 0.2, "--grow-mib", "32", "--grow-max-mib", "192"))
        jobs_to_kill.append(job["pid"])
        row = wait_state(d, job["job"], "parked")
        ck_id = row["parked_checkpoint"]
        assert json.loads(d.ctl("--json", "status", check=True).stdout)["tier_used_bytes"] == 0
        assert wait_durable(d, ck_id)["state"] == "durable"
        wait_for(lambda: not (spill / ck_id).exists(), 60, 0.1, "the spill copy in RAM to be evicted")
        assert json.loads(d.ctl("--json", "show", ck_id, check=True).stdout)["parked_reason"] == row["parked_reason"]
        resumed = json.loads(d.ctl("--json", "resume", job["job"], "--memory-limit", "512M", check=True).stdout)
        jobs_to_kill.append(resumed["pid"])
        assert resumed["from_store"] is True
        assert_continues(job["log"], job["pid"], resumed["pid"])
    finally:
        d.stop()
        subprocess.run(["rm", "-rf", str(spill)], check=False)


def test_v1_memory_pressure_level_watcher_parks_a_job_whose_cgroup_reclaims(
        make_daemon: Any, tmp_path: Path, jobs_to_kill: list[int]) -> None:
    """A job that only reads a file twice its --memory-limit never waits at the limit (its page cache is
    reclaimed), so the oom_control watcher stays silent; its cgroup's memory.pressure_level (level low here)
    fires, and the guard parks it for that reason. No OOM kill, and under_oom never set."""
    data = tmp_path / "data.bin"
    with open(data, "wb") as f:
        for _ in range(128):
            f.write(os.urandom(M))
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # its cache was charged to us: drop it
    cfg = write_config(tmp_path / "pressure.toml", '[guard]\npressure_level = "low"\n')
    d = make_daemon("pressure", extra=["--config", cfg]).start()
    assert "memory.pressure_level low" in d.ctl("status", check=True).stdout
    job = run_job(d, "--memory-limit", "64M", "--name", "reader",
                  argv=["sh", "-c", f"while :; do cat {data} > /dev/null; done"])
    jobs_to_kill.append(job["pid"])
    cgroup = guard_jobs(d)[job["job"]]["cgroup"]
    row = wait_state(d, job["job"], "parked")
    assert "memory.pressure_level low" in row["parked_reason"], row
    assert oom_control(cgroup)["under_oom"] == 0 and oom_control(cgroup).get("oom_kill", 0) == 0
    assert guard_jobs(d)[job["job"]]["stats"]["at_limit_at_trigger"] is False


def test_parked_job_resumes_after_a_daemon_restart(make_daemon: Any, jobs_to_kill: list[int]) -> None:
    d = make_daemon("restart").start()
    job = run_job(d, "--memory-limit", "96M", argv=counter_argv(16, 0.2, "--grow-mib", "32", "--grow-max-mib", "96"))
    jobs_to_kill.append(job["pid"])
    wait_state(d, job["job"], "parked")
    assert d.stop() == 0
    d.start()
    assert "1 parked" in d.ctl("status", check=True).stdout
    resumed = json.loads(d.ctl("--json", "resume", job["job"], "--memory-limit", "512M", check=True).stdout)
    jobs_to_kill.append(resumed["pid"])
    assert_continues(job["log"], job["pid"], resumed["pid"])


def test_only_root_may_mark_a_job_critical_and_others_resume_only_their_own(
        open_daemon: DaemonProc, jobs_to_kill: list[int]) -> None:
    r = open_daemon.ctl("run", "--priority", "critical", "--", "sleep", "60", user=NOBODY)
    assert r.returncode != 0 and "PERMISSION_DENIED" in r.stderr and "critical" in r.stderr
    job = run_job(open_daemon, "--memory-limit", "64M", argv=counter_argv(8, 0.2, "--grow-mib", "32"))
    jobs_to_kill.append(job["pid"])
    wait_state(open_daemon, job["job"], "parked")
    r = open_daemon.ctl("resume", job["job"], user=NOBODY)
    assert r.returncode != 0 and ("PERMISSION_DENIED" in r.stderr or "NOT_FOUND" in r.stderr), r.stderr
    assert job_row(open_daemon, job["job"])["guard_state"] == "parked"  # type: ignore[index]


# -- node pressure ---------------------------------------------------------------------------------

HOG = r"""
import mmap, os, random, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
size = os.fstat(fd).st_size
m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
pages = size // 4096
s = 0
while True:
    for _ in range(10000):
        s += m[random.randrange(pages) * 4096]
"""


class Hog:
    """Real memory pressure without endangering the node: readers of a file twice the size of their own
    small v1 memory cgroup (sized from the node's memory), so their page cache thrashes: every refault is
    a real memory stall that shows in /proc/pressure/memory, while the node keeps all its free memory."""

    def __init__(self, base: Path) -> None:
        total = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
        self.limit = min(256 * M, max(32 * M, total // 384))
        self.cg = V1 / f"memsnap-test-hog-{os.getpid()}"
        self.file = base / "hog.bin"
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, readers: int = 2, also: str = "") -> None:
        with open(self.file, "wb") as f:
            for _ in range(2 * self.limit // M):
                f.write(os.urandom(M))
        self.cg.mkdir(exist_ok=True)
        (self.cg / "memory.limit_in_bytes").write_text(str(self.limit))
        fd = os.open(self.file, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # its cache was charged to us: drop it
        os.close(fd)
        enter = f"echo $$ > {self.cg / 'cgroup.procs'}" + (f" && echo $$ > {also}" if also else "")
        for _ in range(readers):
            self.procs.append(subprocess.Popen(
                ["sh", "-c", f'{enter} && exec "$0" -c "$1" "$2"', sys.executable, HOG, str(self.file)]))

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
        self.procs = []
        try:
            self.cg.rmdir()
        except OSError:
            pass


UNIFIED = Path("/sys/fs/cgroup/unified")


@pytest.mark.skipif(not (UNIFIED / "cgroup.procs").exists(), reason="no cgroup2 hierarchy mounted")
def test_v2_memory_pressure_trigger_fires_on_real_pressure(tmp_path: Path) -> None:
    """The v2 per-cgroup PSI watcher (CgroupV2.watch_pressure) on this node's real cgroup2 hierarchy, which
    has PSI files though not the memory controller: the hog's stalls fire the trigger (POLLPRI)."""
    import select

    from memsnap.guard.cgroups import CgroupV2

    v2 = CgroupV2(UNIFIED, f"memsnap-test-{os.getpid()}")
    v2.parent.mkdir(exist_ok=True)
    child = v2.parent / "hog"
    child.mkdir(exist_ok=True)
    hog = Hog(tmp_path)
    fd = v2.watch_pressure(child, "some 50000 2000000")
    try:
        p = select.poll()
        p.register(fd, select.POLLPRI)
        assert p.poll(0) == []  # nothing runs there yet
        hog.start(also=str(child / "cgroup.procs"))
        events = wait_for(lambda: p.poll(200), 60, 0, "the memory.pressure trigger to fire")
        assert events[0][1] & select.POLLPRI  # type: ignore[index]
    finally:
        os.close(fd)
        hog.stop()
        for c in (child, v2.parent):
            wait_for(lambda c=c: not c.exists() or not Path(c, "cgroup.procs").read_text().strip(), 10, 0.05)
            c.rmdir()


def psi_some() -> float:
    line = Path("/proc/pressure/memory").read_text().splitlines()[0]
    return float(line.split()[1].split("=")[1])


def test_node_pressure_parks_lowest_priority_first_never_critical_and_auto_resumes(
        make_daemon: Any, tmp_path: Path, jobs_to_kill: list[int]) -> None:
    cfg = write_config(tmp_path / "node.toml", "[guard]\npsi_some_avg10 = 10.0\nsustain_s = 1.0\n"
                       "cooldown_s = 2.0\nresume_below_some_avg10 = 8.0\nresume_sustain_s = 2.0\n"
                       'resume_margin = "64M"\n')
    d = make_daemon("node", extra=["--config", cfg]).start()
    assert "node policy on" in d.ctl("status", check=True).stdout
    low = run_job(d, "--priority", "-5", "--name", "low", argv=counter_argv(16, 0.1))
    mid = run_job(d, "--priority", "5", "--name", "mid", argv=counter_argv(16, 0.1))
    crit = run_job(d, "--priority", "critical", "--name", "crit", argv=counter_argv(16, 0.1))
    jobs_to_kill.extend([low["pid"], mid["pid"], crit["pid"]])
    wait_for(lambda: psi_some() < 8.0, 120, 0.5, "node PSI to settle below the resume threshold first")
    hog = Hog(tmp_path)
    try:
        hog.start()
        wait_state(d, low["job"], "parked", 120)
        assert job_row(d, mid["job"])["guard_state"] == "running"  # type: ignore[index]
        assert job_row(d, crit["job"])["guard_state"] == "running"  # type: ignore[index]
        wait_state(d, mid["job"], "parked", 120)
        # pressure goes on with only the critical job left: it is never touched
        time.sleep(4)
        crit_row = job_row(d, crit["job"])
        assert crit_row is not None and crit_row["guard_state"] == "running" and crit_row["running"]
        g = guard_jobs(d)
        assert g[low["job"]]["parked_ms"] < g[mid["job"]]["parked_ms"]
    finally:
        hog.stop()
    # auto-resume once pressure stays low: the higher priority first
    wait_state(d, mid["job"], "resumed", 180)
    wait_state(d, low["job"], "resumed", 180)
    g = guard_jobs(d)
    new_mid, new_low = g[mid["job"]]["resumed_as"], g[low["job"]]["resumed_as"]
    assert g[new_mid]["stats"]["resumed_from"] == mid["job"]
    rows = {r["id"]: r for r in json.loads(d.ctl("--json", "jobs", check=True).stdout)}
    assert rows[new_mid]["started_unix_ms"] < rows[new_low]["started_unix_ms"]
    for orig, new in ((low, new_low), (mid, new_mid)):
        jobs_to_kill.append(rows[new]["pid"])
        assert_continues(orig["log"], orig["pid"], rows[new]["pid"])
    assert d.log.read_text().count("pressure low for") == 2  # both came back by auto-resume


def test_a_guarded_job_stays_guarded_after_a_restore_and_is_parked_at_its_limit_there(
        daemon: DaemonProc, jobs_to_kill: list[int]) -> None:
    # A job started with --memory-limit sits in its own memory cgroup (OOM kill off: at the limit it waits). Its
    # restored copy went back into that cgroup unguarded: at the limit it waited for ever, parked by nobody.
    job = run_job(daemon, "--memory-limit", "160M", "--name", "guarded-restored",
                  argv=counter_argv(16, 0.5, "--grow-mib", "8", "--grow-max-mib", "400"))
    jobs_to_kill.append(job["pid"])
    cgroup = guard_jobs(daemon)[job["job"]]["cgroup"]
    ck = json.loads(daemon.ctl("--json", "checkpoint", job["job"], "--stop", check=True).stdout)
    out = json.loads(daemon.ctl("--json", "restore", ck["id"], check=True).stdout)
    jobs_to_kill.append(out["pid"])
    assert guard_jobs(daemon)[out["job"]]["limit"] == 160 * M
    assert memory_cgroup_of(out["pid"]) == "/" + str(Path(cgroup).relative_to(V1))
    row = wait_state(daemon, out["job"], "parked")
    assert "memory limit" in row["parked_reason"]
