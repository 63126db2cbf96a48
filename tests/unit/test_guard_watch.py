"""The guard's watchers (memsnap.guard.watch): a watcher fd unwatched from another thread while the loop polls it
is closed only when the poll ends, so its number is never reused under the loop's ack."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

from memsnap.guard.watch import Watchers


class EventfdCgroups:
    """A seam for the kernel's cgroup notifications: each watch is a plain eventfd."""

    version = 2

    def watch(self, cg: Path) -> int:
        return os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)

    def ack(self, fd: int) -> None:
        os.eventfd_read(fd)


def test_unwatch_during_a_poll_leaves_a_reused_fd_number_unread() -> None:
    """A park unwatches its job while the loop polls: a socket opened right then (as the relay's accept does)
    keeps every byte sent to it, and the watcher fd is closed once the poll ends."""
    w = Watchers(EventfdCgroups(), "off")  # type: ignore[arg-type]
    w.watch("job-a", Path("/unused"))
    (fd,) = w._fds
    ino = os.fstat(fd).st_ino
    result: list[tuple[set[str], set[str]]] = []
    poller = threading.Thread(target=lambda: result.append(w.wait(0.6)))
    poller.start()
    time.sleep(0.2)  # the poll is under way
    w.unwatch("job-a")
    a, b = socket.socketpair()
    try:
        b.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        poller.join(5)
        assert result == [(set(), set())]
        a.settimeout(1)
        assert a.recv(64) == b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    finally:
        a.close()
        b.close()
    try:
        still = os.fstat(fd).st_ino == ino
    except OSError:
        still = False
    assert not still, "the unwatched eventfd stays open after the poll"


def test_unwatch_outside_a_poll_closes_at_once_and_a_fired_watcher_names_its_job() -> None:
    w = Watchers(EventfdCgroups(), "off")  # type: ignore[arg-type]
    w.watch("job-a", Path("/unused"))
    w.watch("job-b", Path("/unused"))
    fd_a, fd_b = w._fds
    os.eventfd_write(fd_b, 1)
    assert w.wait(0.5) == ({"job-b"}, set())
    assert w.wait(0.05) == (set(), set())  # acknowledged
    w.unwatch("job-a")
    w.unwatch("job-b")
    for fd in (fd_a, fd_b):
        try:
            os.fstat(fd)
        except OSError:
            continue
        raise AssertionError(f"fd {fd} left open")
