"""A job's /tmp is its own (a tmpfs in its mount namespace that goes into its image), and its image keeps
only the host mounts it uses: pid-named temp files (a JVM's hsperfdata/2) no longer collide across jobs, a
job's temp files come back with it, and a restore does not need host mounts the job never used."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers import DaemonProc, jvm_argv, jvm_rounds, wait_for


def _run(d: DaemonProc, jobs_to_kill: list[int], argv: list[str], *flags: str, name: str = "") -> dict:
    job = json.loads(d.ctl("--json", "run", *flags, *(["--name", name] if name else []), "--", *argv,
                           check=True).stdout)
    jobs_to_kill.append(int(job["pid"]))
    return job


def _restore(d: DaemonProc, ck: str, jobs_to_kill: list[int]) -> subprocess.CompletedProcess[str]:
    r = d.ctl("--json", "restore", ck)
    if r.returncode == 0:
        jobs_to_kill.append(int(json.loads(r.stdout)["pid"]))
    return r


def _jvms_checkpointed_then_stopped(d: DaemonProc, jobs_to_kill: list[int], *flags: str) -> list[dict]:
    """Two JVM jobs, each checkpointed while running, then both stopped (SIGTERM: each JVM exits cleanly and
    deletes its perf data file, /tmp/hsperfdata_root/2 in its /tmp); the checkpoints."""
    jobs = [_run(d, jobs_to_kill, jvm_argv(16, 200), *flags, name=f"jvm-{i}") for i in range(2)]
    for j in jobs:
        wait_for(lambda j=j: len(jvm_rounds(j["log"])) >= 2, 60, what="the JVM to print rounds")
    cks = [json.loads(d.ctl("--json", "checkpoint", j["job"], check=True).stdout) for j in jobs]
    for j in jobs:
        d.ctl("stop", j["job"], check=True)
    return [{**ck, "log": j["log"]} for ck, j in zip(cks, jobs, strict=True)]


def test_jvm_checkpoints_restore_after_every_jvm_exited_each_with_its_own_tmp(daemon, jobs_to_kill):
    for ck in _jvms_checkpointed_then_stopped(daemon, jobs_to_kill):
        assert [f for f in (daemon.tier / ck["id"]).iterdir() if f.name.startswith("tmpfs-")], \
            "the job's /tmp is not in its image"
        r = _restore(daemon, ck["id"], jobs_to_kill)
        assert r.returncode == 0, r.stderr
        pid = int(json.loads(r.stdout)["pid"])
        n = len(jvm_rounds(ck["log"]))
        wait_for(lambda ck=ck, n=n: len(jvm_rounds(ck["log"])) >= n + 3, 60, what="the restored JVM to go on")
        assert len({dig for _, dig in jvm_rounds(ck["log"])}) == 1, "the restored JVM's heap changed"
        assert Path(f"/proc/{pid}").exists()


def test_with_the_hosts_tmp_jvms_collide_on_their_perf_data_file(daemon, jobs_to_kill):
    # (what the private /tmp prevents: both JVMs are pid 2, their file /tmp/hsperfdata_root/2 on the host)
    cks = _jvms_checkpointed_then_stopped(daemon, jobs_to_kill, "--shared-tmp")
    failed = [r.stderr for r in (_restore(daemon, ck["id"], jobs_to_kill) for ck in cks) if r.returncode]
    assert failed and "hsperfdata_root/2" in failed[0], failed


def test_a_jobs_temp_files_come_back_with_it(daemon, jobs_to_kill):
    code = ("import os, time\n"
            "open('/tmp/note', 'w').write('kept %d' % os.getpid())\n"
            "while True:\n"
            "    print(open('/tmp/note').read(), flush=True); time.sleep(0.1)\n")
    job = _run(daemon, jobs_to_kill, [sys.executable, "-c", code])
    wait_for(lambda: "kept" in Path(job["log"]).read_text(), 30, what="the job to write its note")
    assert not Path("/tmp/note").exists()  # (the host's /tmp never saw it)
    ck = json.loads(daemon.ctl("--json", "checkpoint", job["job"], "--stop", check=True).stdout)
    r = _restore(daemon, ck["id"], jobs_to_kill)
    assert r.returncode == 0, r.stderr
    restored = json.loads(daemon.ctl("--json", "jobs", check=True).stdout)
    log = next(j["log_path"] for j in restored if j["id"] == json.loads(r.stdout)["job"])
    n = Path(log).read_text().count("kept")
    wait_for(lambda: Path(log).read_text().count("kept") > n + 2, 20, what="the restored job to read its note")


def test_a_program_in_the_hosts_tmp_is_told_why_it_cannot_start_and_runs_with_shared_tmp(daemon, jobs_to_kill):
    where = Path(tempfile.mkdtemp(dir="/tmp"))
    os.chmod(where, 0o755)
    script = where / "hello.sh"
    script.write_text("#!/bin/sh\necho hello from the host's tmp\nsleep 60\n")
    script.chmod(0o755)
    r = daemon.ctl("run", "--", str(script))
    assert r.returncode != 0 and "--shared-tmp" in r.stderr, r.stderr
    job = _run(daemon, jobs_to_kill, [str(script)], "--shared-tmp")
    wait_for(lambda: "hello" in Path(job["log"]).read_text(), 20, what="the script to run")
    shutil.rmtree(where)


@pytest.mark.parametrize("flags", [[], ["--own-proc"]], ids=["private-tmp", "own-proc"])
def test_a_restore_needs_no_host_mount_that_went_away_and_that_the_job_never_used(flags, daemon, jobs_to_kill):
    # A container runtime adds and removes network namespaces (/run/netns/NAME mounts) all day: one that
    # existed when the job started, and when it was dumped, is gone by the time it is restored.
    ns = f"ms-gone-{Path('/proc/self').resolve().name}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        job = _run(daemon, jobs_to_kill, jvm_argv(8, 100), *flags)
        wait_for(lambda: len(jvm_rounds(job["log"])) >= 2, 60, what="the JVM to print rounds")
        assert f"/run/netns/{ns}" in Path(f"/proc/{job['pid']}/mountinfo").read_text()
        ck = json.loads(daemon.ctl("--json", "checkpoint", job["job"], "--stop", check=True).stdout)
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=True)
    r = _restore(daemon, ck["id"], jobs_to_kill)
    assert r.returncode == 0, r.stderr
    n = len(jvm_rounds(job["log"]))
    wait_for(lambda: len(jvm_rounds(job["log"])) >= n + 3, 60, what="the restored JVM to go on")


def test_each_restore_of_a_job_with_its_own_tmp_writes_a_log_of_its_own(daemon, jobs_to_kill):
    # Its output goes through a bind mount in its namespace (/tmp/.memsnap/log): every restore binds a new log
    # there, so two copies of one checkpoint never write into one file, and the old log stays as it was.
    job = _run(daemon, jobs_to_kill, jvm_argv(8, 100))
    wait_for(lambda: len(jvm_rounds(job["log"])) >= 2, 60, what="the JVM to print rounds")
    ck = json.loads(daemon.ctl("--json", "checkpoint", job["job"], "--stop", check=True).stdout)
    old = Path(job["log"]).read_text()
    logs = []
    for _ in range(2):
        r = _restore(daemon, ck["id"], jobs_to_kill)
        assert r.returncode == 0, r.stderr
        listed = json.loads(daemon.ctl("--json", "jobs", check=True).stdout)
        logs.append(next(j["log_path"] for j in listed if j["id"] == json.loads(r.stdout)["job"]))
    assert len(set(logs)) == 2 and job["log"] not in logs
    for log in logs:
        wait_for(lambda log=log: "round" in Path(log).read_text(), 60, what=f"the copy logging to {log} to go on")
        assert Path(log).read_text().startswith(f"# memsnap: restored from {ck['id']}")
    assert Path(job["log"]).read_text() == old
