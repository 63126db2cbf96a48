"""Operations with a real daemon: sd_notify readiness and watchdog, metrics, jobs that outlive the daemon."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import pytest

from memsnap.client import ClientError
from tests.helpers import (
    counter_argv,
    metrics_port,
    sample,
    scrape_metrics,
    start_digest,
    stored_chunk,
    ticks,
    wait_for,
)


def test_sd_notify_ready_only_when_serving_then_watchdog_and_stopping(make_daemon, tmp_path):
    ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ns_path = tmp_path / "notify.sock"
    ns.bind(str(ns_path))
    ns.settimeout(1)
    d = make_daemon("notify", env={"NOTIFY_SOCKET": str(ns_path), "WATCHDOG_USEC": "400000"})
    got: list[str] = []
    serving_at_ready: list[bool] = []
    stop = threading.Event()

    def listen() -> None:
        # Receives during start-up: the moment READY=1 arrives, a status call with a 1 s deadline must work.
        while not stop.is_set():
            try:
                msgs = ns.recv(4096).decode().split("\n")
            except TimeoutError:
                continue
            if "READY=1" in msgs and not serving_at_ready:
                try:
                    with d.client() as c:
                        c.status(timeout=1)
                    serving_at_ready.append(True)
                except ClientError:
                    serving_at_ready.append(False)
            got.extend(msgs)

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    try:
        d.start()
        def pings_after_ready() -> int:  # (0 until READY=1 came: a poll before it must not raise)
            return sum(m == "WATCHDOG=1" for m in got[got.index("READY=1"):]) if "READY=1" in got else 0

        wait_for(lambda: pings_after_ready() >= 3, 20, what="three watchdog pings after READY=1")
        assert serving_at_ready == [True]
        ready_at = got.index("READY=1")
        assert all(not m.startswith("READY") for m in got[:ready_at])
        assert any(m.startswith("STATUS=tier ") and "drain queue" in m for m in got)
        d.stop(signal.SIGTERM)
        wait_for(lambda: "STOPPING=1" in got, 5, what="STOPPING=1")
    finally:
        stop.set()
        t.join(5)
        ns.close()


def test_metrics_record_every_documented_series_from_a_real_daemon(make_daemon, jobs_to_kill):
    d = make_daemon("metrics", extra=["--metrics-listen", "127.0.0.1:0"]).start()
    port = metrics_port(d)
    before = scrape_metrics(port)
    for name in ("memsnap_tier_capacity_bytes", "memsnap_tier_used_bytes", "memsnap_drain_queue_depth",
                 "memsnap_drain_queue_bytes", "memsnap_moves_in_doubt", "memsnap_drained_bytes_total"):
        assert any(k[0] == name for k in before), name
    with d.client() as c:
        job = c.run(counter_argv(8))
        jobs_to_kill.append(int(job.pid))
        wait_for(lambda: ticks(job.log_path), 20)
        ck = c.checkpoint(job.pid, wait_durable=True)
        after = scrape_metrics(port)
        # Checkpoint: freeze and dump are timed from CRIU's stats; the tree is frozen for part of the dump.
        assert sample(after, "memsnap_checkpoints_total", result="ok") == \
            sample(before, "memsnap_checkpoints_total", result="ok") + 1
        assert sample(after, "memsnap_phase_seconds_count", phase="freeze") >= 1
        assert sample(after, "memsnap_phase_seconds_count", phase="dump") >= 1
        assert 0 < sample(after, "memsnap_phase_seconds_sum", phase="freeze") < \
            sample(after, "memsnap_phase_seconds_sum", phase="dump")
        assert sample(after, "memsnap_phase_seconds_count", phase="drain") == 1
        size = c.show(ck.id).size_bytes
        assert sample(after, "memsnap_drained_bytes_total") == size > 0
        # Restore from the store: a fetch, then a restore.
        c.evict(ck.id)
        r = c.restore(ck.id)
        jobs_to_kill.append(int(r.pid))
        after = scrape_metrics(port)
        assert sample(after, "memsnap_restores_total", result="ok") == 1
        assert sample(after, "memsnap_phase_seconds_count", phase="fetch") == 1
        assert sample(after, "memsnap_phase_seconds_count", phase="restore") == 1
        # A storage error: a stored object gone, so the fetch fails and is counted.
        ck2 = c.checkpoint(r.pid, wait_durable=True)
        c.evict(ck2.id)
        m = json.loads((d.store / ck2.id / "manifest.json").read_text())
        big = max(m["files"], key=lambda n: m["files"][n]["size"])
        stored_chunk(d.store, m, m["storage"]["files"][big]["chunks"][0][0])[0].unlink()  # (its pack, or itself)
        with pytest.raises(ClientError):
            c.restore(ck2.id)
    after = scrape_metrics(port)
    assert sample(after, "memsnap_storage_errors_total", op="get") == 1
    assert sample(after, "memsnap_restores_total", result="ok") == 1
    assert all(k[0].startswith(("memsnap_", "python_", "process_")) for k in after)


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
    assert f"test-only knob MEMSNAP_FAILPOINTS='{where}' is set" in d.log.read_text()
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


def test_a_state_dir_too_deep_for_a_unix_socket_path_still_serves(make_daemon, tmp_path):
    # A Unix socket path holds at most 107 bytes: the private socket under a deep state dir is bound through
    # an fd of its directory (pytest's own numbered temp dirs alone reached that length on a busy machine).
    deep = "d" * 90
    d = make_daemon(deep, socket_path=str(tmp_path / "d.sock"))
    assert len(str(d.state / "private" / "grpc.sock")) > 107
    d.start()
    assert "memsnapd" in d.ctl("status", check=True).stdout


def test_sigusr1_writes_every_threads_stack_to_the_log_and_the_daemon_serves_on(daemon):
    before = daemon.log.stat().st_size
    daemon.proc.send_signal(signal.SIGUSR1)

    def dumped() -> str | None:
        text = daemon.log.read_bytes()[before:].decode(errors="replace")
        return text if "most recent call first" in text and "in _accept_loop" in text else None

    dump = wait_for(dumped, 10, 0.1, "the stack dump in the log")
    assert "Thread 0x" in dump  # every thread, not only the main one
    assert daemon.proc.poll() is None
    assert "memsnapd" in daemon.ctl("status", check=True).stdout
