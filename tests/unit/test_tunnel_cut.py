"""The target end of a lazy move's page tunnel (memsnap.move.tunnel): a cut after the transfer ended well
leaves the moved job alone."""

from __future__ import annotations

import socket
import subprocess

from memsnap.lazyguard import LazyGuard
from memsnap.move.psflow import PageFlow
from memsnap.move.tunnel import Seal, TunnelHost, _Tunnel
from memsnap.pageserver.wire import IOV_41


def _tunnel(job: subprocess.Popen[bytes]) -> _Tunnel:
    criu_end, pump = socket.socketpair()
    tid = "ab" * 8
    t = _Tunnel(tid, "ck-1", criu_end, pump, Seal("tok", tid, "to-target"), Seal("tok", tid, "to-source"),
                PageFlow(IOV_41), restore_started=True, guard=LazyGuard("move"))
    t.guard.pid = job.pid
    return t


def test_a_late_cut_after_every_page_arrived_leaves_the_moved_job_running() -> None:
    """The feeder thread outlived its join and failed on the closed pump: the move had succeeded already."""
    job = subprocess.Popen(["sleep", "30"])
    try:
        t = _tunnel(job)
        t.verdict = (True, "")
        t.settled.set()
        TunnelHost(None)._cut(t, "the page tunnel broke: [Errno 9] Bad file descriptor")  # type: ignore[arg-type]
        assert job.poll() is None and t.broken == ""
    finally:
        job.kill()
        job.wait()


def test_a_cut_before_the_transfer_ended_kills_the_half_moved_job() -> None:
    job = subprocess.Popen(["sleep", "30"])
    try:
        t = _tunnel(job)
        TunnelHost(None)._cut(t, "the source ended the page tunnel")  # type: ignore[arg-type]
        assert job.wait(5) is not None and t.broken == "the source ended the page tunnel"
    finally:
        job.kill()
        job.wait()
