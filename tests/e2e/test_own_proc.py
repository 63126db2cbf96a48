"""Jobs with their own /proc (memsnapctl run --own-proc, the default on GPU nodes), with real CRIU.

CUDA fails to initialise in a PID namespace that sees the host's /proc, so such jobs get a mount namespace
with a fresh procfs; CRIU must then dump and restore that namespace without dumping the host's mounts.
The counter workload prints the pid /proc/self names: 2 (the init's child) in its own
procfs (the host pid otherwise), so
lines of an own-/proc job are told apart by their order, not by that field.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from memsnap import jobinit
from tests.helpers import (
    NOBODY,
    REPO,
    DaemonProc,
    Tick,
    counter_argv,
    job_output,
    kill_job,
    start_digest,
    ticks,
    wait_for,
)


def _run(d: DaemonProc, jobs_to_kill: list[int], mib: int, name: str, *flags: str,
         extra: tuple[str, ...] = ()) -> dict:
    argv = counter_argv(mib, 0.1, *extra)
    job = json.loads(d.ctl("--json", "run", *flags, "--name", name, "--", *argv, check=True).stdout)
    jobs_to_kill.append(int(job["pid"]))
    wait_for(lambda: len(ticks(job["log"])) >= 3, 30, what="the job to tick")
    return {**job, "argv": argv}


def _sees_own_proc(pid: int, argv: list[str]) -> None:
    """pid is init of its PID namespace and its /proc is that namespace's: /proc/1 there is pid itself (the
    job's tiny init), and the command runs as its child."""
    assert os.stat(f"/proc/{pid}/ns/mnt").st_ino != os.stat("/proc/self/ns/mnt").st_ino
    init = Path(f"/proc/{pid}/root/proc/1/cmdline").read_bytes().split(b"\0")[:-1]
    assert jobinit.is_init([a.decode() for a in init])
    assert init == Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
    kids = wait_for(lambda: [c for c in psutil.Process(pid).children() if c.cmdline()[1:] == argv[1:]], 10,
                    what="the init to start the command")
    assert kids, argv
    mounts = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
    assert [m for m in mounts if m.split()[4] == "/proc" and " - proc " in m], "no procfs on /proc"


def _after(log: str, count: int) -> list[Tick]:
    return ticks(log)[count:]


def _checkpoint(d: DaemonProc, key: str, *flags: str) -> dict:
    return json.loads(d.ctl("--json", "checkpoint", key, *flags, check=True).stdout)


def _restore(d: DaemonProc, ck: str, jobs_to_kill: list[int], *flags: str) -> int:
    pid = int(json.loads(d.ctl("--json", "restore", *flags, ck, check=True).stdout)["pid"])
    jobs_to_kill.append(pid)
    return pid


def _stop_point(d: DaemonProc, job: dict) -> tuple[dict, int, int]:
    """checkpoint --stop: the image, the last tick and how many tick lines the log then holds."""
    ck = _checkpoint(d, job["job"], "--stop")
    wait_for(lambda: not Path(f"/proc/{job['pid']}").exists(), 10, what="the stopped job to be gone")
    done = ticks(job["log"])
    return ck, done[-1].n, len(done)


def test_an_own_proc_job_sees_its_own_proc(daemon, jobs_to_kill):
    job = _run(daemon, jobs_to_kill, 8, "ownproc-sees", "--own-proc")
    _sees_own_proc(int(job["pid"]), job["argv"])
    assert {t.hostpid for t in ticks(job["log"])} == {2}  # the command, the init's child, in its own procfs


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="the default is the job's own /proc on a GPU node")
def test_without_a_gpu_a_job_gets_the_hosts_proc_by_default(daemon, jobs_to_kill):
    job = _run(daemon, jobs_to_kill, 8, "ownproc-default")
    pid = int(job["pid"])
    # (a mount namespace it has, for its private /tmp: memsnap.mounts; but the /proc in it is ours)
    assert os.stat(f"/proc/{pid}/root/proc").st_dev == os.stat("/proc").st_dev
    assert {t.hostpid for t in ticks(job["log"])} == {pid}


def test_checkpoint_then_restore_resumes_at_the_next_tick_with_the_same_memory(daemon, jobs_to_kill):
    job = _run(daemon, jobs_to_kill, 64, "ownproc-roundtrip", "--own-proc")
    digest0 = start_digest(job["log"])
    before = ticks(job["log"])[-1].n
    ck = _checkpoint(daemon, job["job"])
    after = ticks(job["log"])[-1].n
    n = len(ticks(job["log"]))
    wait_for(lambda: len(ticks(job["log"])) >= n + 3, 10, what="ticks after a plain checkpoint")

    # The image holds the job's mount namespace, but none of the host's mounts: no tmpfs of /dev/shm, only
    # the job's own (empty) /tmp.
    files = sorted(p.name for p in (daemon.tier / ck["id"]).iterdir())
    assert any(f.startswith("mountpoints-") for f in files), files
    tmpfs = [f for f in files if f.startswith("tmpfs-")]
    assert len(tmpfs) == 1 and (daemon.tier / ck["id"] / tmpfs[0]).stat().st_size < 4096, files
    assert json.loads((daemon.tier / ck["id"] / "manifest.json").read_text())["own_mntns"] is True

    # The job is dumped between the ticks seen before and after the call; the copy goes on from there.
    kill_job(int(job["pid"]))
    wait_for(lambda: not Path(f"/proc/{job['pid']}").exists(), 10, what="the job to be gone")
    count = len(ticks(job["log"]))
    pid = _restore(daemon, ck["id"], jobs_to_kill)
    wait_for(lambda: len(_after(job["log"], count)) >= 3, 20, what="the restored job to tick")
    resumed = _after(job["log"], count)
    assert before + 1 <= resumed[0].n <= after + 1
    assert [t.n for t in resumed[:3]] == [resumed[0].n, resumed[0].n + 1, resumed[0].n + 2]
    assert all(t.digest == digest0 and t.hostpid == 2 for t in resumed)
    _sees_own_proc(pid, job["argv"])


def test_stop_then_restore_resumes_at_the_next_tick_with_the_same_memory(daemon, jobs_to_kill):
    job = _run(daemon, jobs_to_kill, 64, "ownproc-stop", "--own-proc")
    digest0 = start_digest(job["log"])
    ck, last, count = _stop_point(daemon, job)
    pid = _restore(daemon, ck["id"], jobs_to_kill)
    wait_for(lambda: len(_after(job["log"], count)) >= 3, 20, what="the restored job to tick")
    resumed = _after(job["log"], count)
    assert [t.n for t in resumed[:3]] == [last + 1, last + 2, last + 3]
    assert all(t.digest == digest0 and t.hostpid == 2 for t in resumed)
    _sees_own_proc(pid, job["argv"])


def test_lazy_restore_resumes_at_the_next_tick_with_the_same_memory(daemon, jobs_to_kill):
    mib = 64
    job = _run(daemon, jobs_to_kill, mib, "ownproc-lazy", "--own-proc", extra=("--digest-every", "5"))
    digest0 = start_digest(job["log"])
    ck, last, count = _stop_point(daemon, job)
    pid = _restore(daemon, ck["id"], jobs_to_kill, "--lazy")
    wait_for(lambda: len(_after(job["log"], count)) >= 6, 30, what="the lazily restored job to tick")
    resumed = _after(job["log"], count)
    assert resumed[0].n == last + 1
    assert all(t.digest == digest0 for t in resumed) and any(t.fresh for t in resumed)
    _sees_own_proc(pid, job["argv"])
    tree = lambda: [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]  # noqa: E731
    wait_for(lambda: sum(p.memory_info().rss for p in tree()) >= mib << 20, 60, what="every page to arrive")


def test_two_concurrent_restores_of_one_image_both_resume(daemon, jobs_to_kill):
    job = _run(daemon, jobs_to_kill, 16, "ownproc-twins", "--own-proc")
    digest0 = start_digest(job["log"])
    ck, last, _ = _stop_point(daemon, job)
    procs = [subprocess.Popen([sys.executable, "-m", "memsnap.cli", "--json", "restore", ck["id"]],
                              env={**os.environ, "PYTHONPATH": str(REPO), "MEMSNAP_SOCKET": daemon.socket},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    pids = [int(json.loads(o[0])["pid"]) for o in outs]
    jobs_to_kill.extend(pids)
    assert len(set(pids)) == 2
    # Both copies print the same lines (pid 1 in their own /proc): each tick after the image, twice, each copy
    # into a log of its own (its private /tmp's log mount: memsnap.mounts). Count every "tick N PID DIGEST".
    want = [last + 1, last + 2, last + 3]

    def seen() -> list[tuple[int, str]]:
        found = re.findall(r"tick (\d+) \d+ ([0-9a-f]{16})", job_output(job["log"]))
        return [(int(n), d) for n, d in found if int(n) > last]

    wait_for(lambda: all([n for n, _ in seen()].count(n) == 2 for n in want), 20, what="both copies to tick")
    assert {d for _, d in seen()} == {digest0}
    for pid in pids:
        _sees_own_proc(pid, job["argv"])
    assert os.stat(f"/proc/{pids[0]}/ns/mnt").st_ino != os.stat(f"/proc/{pids[1]}/ns/mnt").st_ino


def test_a_tmpfs_the_host_unmounted_after_the_job_started_is_left_out_of_the_image(daemon, jobs_to_kill, tmp_path):
    # The job's mount namespace is a copy taken at its start: a tmpfs (a tier, say) unmounted on the host
    # since stays mounted in there, and CRIU would dump everything in it as a tarball.
    tier = tmp_path / "old-tier"
    tier.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "old-tier", str(tier)], check=True)
    try:
        subprocess.run(["mount", "--make-private", str(tier)], check=True)  # the unmount stays on the host
        (tier / "someone-elses-image").write_bytes(os.urandom(1 << 20))
        job = _run(daemon, jobs_to_kill, 8, "ownproc-vanished", "--own-proc")
    finally:
        subprocess.run(["umount", str(tier)], check=True)
    assert str(tier) in Path(f"/proc/{job['pid']}/mountinfo").read_text()
    digest0 = start_digest(job["log"])
    ck, last, count = _stop_point(daemon, job)
    big = [p.name for p in (daemon.tier / ck["id"]).iterdir()
           if p.name.startswith("tmpfs-") and p.stat().st_size > 4096]
    assert not big, big  # (only the job's own, empty /tmp)
    pid = _restore(daemon, ck["id"], jobs_to_kill)
    wait_for(lambda: len(_after(job["log"], count)) >= 3, 20, what="the restored job to tick")
    resumed = _after(job["log"], count)
    assert resumed[0].n == last + 1 and all(t.digest == digest0 for t in resumed)
    assert str(tier) not in Path(f"/proc/{pid}/mountinfo").read_text()


_RUN_AS_NOBODY = """import os, sys
from memsnap.client import MemsnapClient
c = MemsnapClient(socket=sys.argv[1])  # imported as root (the interpreter lives under /root)...
os.setgroups([]); os.setgid(65534); os.setuid(65534)  # ...the call is made as nobody
print(c.run(["/bin/bash", "-c", "sleep 30; exit 0"], env={"BASH_ENV": sys.argv[2]}, own_proc=True).pid)
"""


def test_the_callers_bash_startup_file_never_runs_as_root_in_an_own_proc_launch(open_daemon, jobs_to_kill):
    # The job's files are reopened by a root step inside its new mount namespace; nothing in the caller's
    # environment (here BASH_ENV) may run there. The marker records every uid it ran as.
    box = Path(tempfile.mkdtemp(prefix="memsnap-bashenv-"))
    os.chmod(box, 0o777)
    marker, rc = box / "ran-as", box / "rc.sh"
    rc.write_text(f"id -u >> {marker}\n")
    os.chmod(rc, 0o755)
    try:
        r = subprocess.run([sys.executable, "-c", _RUN_AS_NOBODY, open_daemon.socket, str(rc)], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert r.returncode == 0, r.stderr
        pid = int(r.stdout)
        jobs_to_kill.append(pid)
        # A root step would read it first (and leave a marker nobody cannot append to).
        wait_for(lambda: marker.exists() and marker.read_text().split(), 10, what="BASH_ENV to be read")
        assert "0" not in marker.read_text().split(), "the caller's BASH_ENV ran as root"
        wait_for(lambda: str(NOBODY) in marker.read_text().split(), 10,
                 what="the job's own bash to read BASH_ENV as the caller")
        assert psutil.Process(pid).uids().real == NOBODY
        _sees_own_proc(pid, ["/bin/bash", "-c", "sleep 30; exit 0"])
    finally:
        shutil.rmtree(box, ignore_errors=True)


class _SharedMountsDaemon(DaemonProc):
    """A daemon in a mount namespace whose mounts are all shared, as systemd makes a host's."""

    def args(self) -> list[str]:
        return ["unshare", "--mount", "--propagation", "shared", "--", *super().args()]


def test_with_shared_host_mounts_a_restored_job_still_receives_the_hosts_new_mounts(tmp_path, jobs_to_kill):
    d = _SharedMountsDaemon(tmp_path / "shared").start()
    try:
        job = _run(d, jobs_to_kill, 16, "ownproc-shared", "--own-proc")
        digest0 = start_digest(job["log"])
        ck, last, count = _stop_point(d, job)
        pid = _restore(d, ck["id"], jobs_to_kill)
        wait_for(lambda: len(_after(job["log"], count)) >= 3, 20, what="the restored job to tick")
        resumed = _after(job["log"], count)
        assert resumed[0].n == last + 1 and all(t.digest == digest0 for t in resumed)
        _sees_own_proc(pid, job["argv"])
        # The job's mounts are slaves of the host's again: a mount made on the host shows up in the job.
        later = tmp_path / "mounted-later"
        later.mkdir()
        assert d.proc is not None
        subprocess.run(["nsenter", "-t", str(d.proc.pid), "-m", "mount", "-t", "tmpfs", "-o", "size=1m", "later",
                        str(later)], check=True)
        assert any(ln.split()[4] == str(later) for ln in Path(f"/proc/{pid}/mountinfo").read_text().splitlines())
    finally:
        d.cleanup()


@pytest.mark.parametrize("how", [[], ["--lazy"]], ids=["default", "lazy"])
def test_a_moved_own_proc_job_resumes_on_the_target_at_the_next_tick(how, tmp_path_factory, jobs_to_kill):
    from tests.helpers import two_daemons

    pairs = two_daemons(tmp_path_factory)
    pair = next(pairs)
    try:
        a, b = pair.a, pair.b
        job = _run(a, jobs_to_kill, 32, "ownproc-mover", "--own-proc", extra=("--digest-every", "10"))
        digest0 = start_digest(job["log"])
        r = a.ctl("--json", "migrate", job["job"], "--to", b.address, *how, timeout=180)  # type: ignore[attr-defined]
        assert r.returncode == 0, r.stderr + a.log.read_text()[-2000:] + b.log.read_text()[-2000:]
        pid = int(json.loads(r.stdout)["target_pid"])
        jobs_to_kill.append(pid)
        assert not Path(f"/proc/{job['pid']}").exists()
        n = len(ticks(job["log"]))
        wait_for(lambda: len(ticks(job["log"])) >= n + 12, 30, what="the moved job to tick")
        # One copy at a time, so the ticks run on without a gap or a repeat, all with the same memory.
        got = ticks(job["log"])
        assert [t.n for t in got] == list(range(1, len(got) + 1))
        assert all(t.digest == digest0 for t in got) and any(t.fresh for t in got[n:])
        _sees_own_proc(pid, job["argv"])
    finally:
        next(pairs, None)
