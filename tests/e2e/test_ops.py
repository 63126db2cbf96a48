"""Operations with a real daemon: sd_notify readiness and watchdog, metrics, jobs that outlive the daemon."""

from __future__ import annotations

import json
import signal
import socket
import time
import urllib.request

import pytest

from tests.helpers import counter_argv, start_digest, ticks, wait_for


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return int(port)


def test_sd_notify_ready_only_when_serving_then_watchdog_and_stopping(make_daemon, tmp_path):
    ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ns_path = tmp_path / "notify.sock"
    ns.bind(str(ns_path))
    ns.settimeout(30)
    d = make_daemon("notify", env={"NOTIFY_SOCKET": str(ns_path), "WATCHDOG_USEC": "400000"})
    d.start()
    got: list[str] = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and sum(m == "WATCHDOG=1" for m in got) < 3:
        got.extend(ns.recv(4096).decode().split("\n"))
    ready_at = got.index("READY=1")
    # READY=1 comes only after the socket answers: the client call in d.start() had to succeed first,
    # and nothing before READY claims readiness.
    assert all(not m.startswith("READY") for m in got[:ready_at])
    assert sum(m == "WATCHDOG=1" for m in got[ready_at:]) >= 3
    assert any(m.startswith("STATUS=tier ") and "drain queue" in m for m in got)
    d.stop(signal.SIGTERM)
    rest = []
    ns.settimeout(5)
    try:
        while "STOPPING=1" not in rest:
            rest.extend(ns.recv(4096).decode().split("\n"))
    except TimeoutError:
        pass
    assert "STOPPING=1" in rest


def test_metrics_checkpoint_counter_rises(make_daemon, jobs_to_kill):
    port = _free_port()
    d = make_daemon("metrics", extra=["--metrics-listen", f"127.0.0.1:{port}"]).start()

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()

    def count(text: str) -> float:
        for line in text.splitlines():
            if line.startswith('memsnap_checkpoints_total{result="ok"}'):
                return float(line.split()[-1])
        return 0.0

    before = scrape()
    assert "memsnap_tier_capacity_bytes" in before and "memsnap_drain_queue_depth" in before
    assert "memsnap_moves_in_doubt 0.0" in before
    with d.client() as c:
        job = c.run(counter_argv(8))
        jobs_to_kill.append(int(job.pid))
        wait_for(lambda: ticks(job.log_path), 20)
        c.checkpoint(job.pid, wait_durable=True)
    after = scrape()
    assert count(after) == count(before) + 1
    assert 'memsnap_phase_seconds_count{phase="dump"}' in after
    assert 'memsnap_phase_seconds_count{phase="drain"} 1.0' in after
    assert all(ln.startswith(("#", "memsnap_")) or not ln for ln in after.splitlines()
               if not ln.startswith(("python_", "process_")))


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill-9"])
def test_jobs_outlive_the_daemon_and_are_readopted(make_daemon, jobs_to_kill, how):
    d = make_daemon(f"outlive-{how.name}").start()
    with d.client() as c:
        launched = c.run(counter_argv(16), name="launched")
        jobs_to_kill.append(int(launched.pid))
        src = c.run(counter_argv(16), name="to-restore")
        jobs_to_kill.append(int(src.pid))
        wait_for(lambda: len(ticks(src.log_path)) >= 2 and ticks(launched.log_path), 20)
        ck = c.checkpoint(src.id, stop=True)
        restored = c.restore(ck.id)
        jobs_to_kill.append(int(restored.pid))
    digest = start_digest(launched.log_path)
    d.stop(how)
    time.sleep(1.0)
    for log, pid in ((launched.log_path, int(launched.pid)), (src.log_path, int(restored.pid))):
        n = len(ticks(log, pid))
        wait_for(lambda log=log, pid=pid, n=n: len(ticks(log, pid)) > n + 3, 10,
                 what=f"job {pid} to keep ticking with the daemon gone")
    d.start()
    with d.client() as c:
        assert ck.id in [k.id for k in c.list()]
        running = {j.id: j for j in c.jobs() if j.running}
        assert launched.id in running and restored.job.id in running
        again = c.checkpoint(launched.id)  # re-adopted: checkpointable by its job id
        assert again.state in (2, 3, 4)
        again2 = c.checkpoint(restored.job.id, stop=True)
    pid = json.loads(d.ctl("--json", "restore", again2.id, check=True).stdout)["pid"]
    jobs_to_kill.append(pid)
    wait_for(lambda: ticks(src.log_path, pid), 20, what="the re-adopted job's restore to tick")
    assert ticks(launched.log_path, int(launched.pid))[-1].digest == digest


def test_print_config_and_bad_config_value(tmp_path):
    import subprocess
    import sys

    from tests.helpers import REPO

    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "memsnap.daemon", "--config", "/dev/null", "--print-config",
                        "--tier-dir", "/dev/shm/x"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and 'dir = "/dev/shm/x"' in r.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text("[drain]\nconcurrency = \"lots\"\n")
    r = subprocess.run([sys.executable, "-m", "memsnap.daemon", "--config", str(bad)], capture_output=True,
                       text=True, env=env)
    assert r.returncode != 0 and "drain.concurrency" in r.stderr


@pytest.mark.parametrize("where", ["before-publish", "after-publish"])
def test_daemon_crash_during_stop_checkpoint_never_leaves_job_frozen(make_daemon, jobs_to_kill, where):
    import psutil

    from memsnap.client import ClientError

    d = make_daemon(f"crash-{where}", env={"MEMSNAP_FAILPOINTS": where}).start()
    with d.client() as c:
        job = c.run(counter_argv(16), name="victim")
        jobs_to_kill.append(int(job.pid))
        wait_for(lambda: len(ticks(job.log_path)) >= 2, 20)
        with pytest.raises(ClientError):
            c.checkpoint(job.id, stop=True)  # the daemon dies mid-way
    assert d.proc is not None and d.proc.wait(10) == 137
    # CRIU left the tree stopped (the --stop dump had finished): the job is frozen until recovery.
    assert psutil.Process(int(job.pid)).status() == psutil.STATUS_STOPPED
    d.env = {}
    d.start()
    with d.client() as c:
        cks = [k for k in c.list() if k.job == job.id]
        assert len(cks) == 1
        if where == "before-publish":
            # Rolled back: no restorable image, the job runs on.
            assert cks[0].state == 5 and not (d.tier / cks[0].id).exists()
            n = len(ticks(job.log_path))
            wait_for(lambda: len(ticks(job.log_path)) > n + 2, 10, what="the job to run again")
        else:
            # Rolled forward: the image was published, so the stop is completed and the image restores.
            assert cks[0].state in (2, 3, 4)
            wait_for(lambda: not psutil.pid_exists(int(job.pid)) or
                     psutil.Process(int(job.pid)).status() == psutil.STATUS_ZOMBIE, 10)
            last = ticks(job.log_path, int(job.pid))[-1].n
            r = c.restore(cks[0].id)
            jobs_to_kill.append(int(r.pid))
            wait_for(lambda: ticks(job.log_path, int(r.pid)), 20)
            assert ticks(job.log_path, int(r.pid))[0].n == last + 1
