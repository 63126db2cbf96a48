"""sd_notify client and heartbeat against a real AF_UNIX datagram socket."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from memsnap.sdnotify import Heartbeat, Notifier


class Receiver:
    """Collects datagrams sent to a bound notify socket."""

    def __init__(self, sock: socket.socket) -> None:
        """Start collecting from sock in a thread."""
        self.sock = sock
        self.messages: list[str] = []
        self._lock = threading.Lock()
        sock.settimeout(0.05)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.messages.append(data.decode())

    def snapshot(self) -> list[str]:
        """Messages received so far."""
        with self._lock:
            return list(self.messages)

    def wait_for(self, predicate: Callable[[list[str]], bool], timeout: float = 5.0) -> list[str]:
        """Wait until predicate(messages) is true; return the messages."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msgs = self.snapshot()
            if predicate(msgs):
                return msgs
            time.sleep(0.01)
        raise AssertionError(f"timed out; got {self.snapshot()}")

    def close(self) -> None:
        """Stop collecting and close the socket."""
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


@pytest.fixture
def path_socket(tmp_path: Path) -> Iterator[tuple[str, Receiver]]:
    """A notify socket bound to a filesystem path."""
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    receiver = Receiver(sock)
    yield path, receiver
    receiver.close()


@pytest.fixture
def abstract_socket() -> Iterator[tuple[str, Receiver]]:
    """A notify socket in the abstract namespace, named as '@name'."""
    name = f"memsnap-test-{os.getpid()}-{time.monotonic_ns()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    receiver = Receiver(sock)
    yield "@" + name, receiver
    receiver.close()


def run_lifecycle(monkeypatch: pytest.MonkeyPatch, address: str, receiver: Receiver) -> list[str]:
    """READY, heartbeat for a while, STOPPING; return what arrived."""
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    monkeypatch.setenv("WATCHDOG_USEC", "200000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    notifier = Notifier.from_env()
    interval = notifier.watchdog_interval()
    assert interval is not None
    assert interval == pytest.approx(0.1)
    assert notifier.ready()
    beat = Heartbeat(notifier, healthy=lambda: True, status=lambda: "tier 1/2 GiB", interval=interval)
    beat.start()
    receiver.wait_for(lambda m: m.count("WATCHDOG=1") >= 2)
    beat.stop()
    assert notifier.stopping()
    msgs = receiver.wait_for(lambda m: "STOPPING=1" in m)
    notifier.close()
    return msgs


def test_ready_watchdog_status_stopping_over_path_socket(
    monkeypatch: pytest.MonkeyPatch, path_socket: tuple[str, Receiver]
) -> None:
    msgs = run_lifecycle(monkeypatch, *path_socket)
    assert msgs[0] == "READY=1"
    assert msgs.count("WATCHDOG=1") >= 2
    assert "STATUS=tier 1/2 GiB" in msgs
    assert msgs[-1] == "STOPPING=1"


def test_abstract_socket_works(
    monkeypatch: pytest.MonkeyPatch, abstract_socket: tuple[str, Receiver]
) -> None:
    msgs = run_lifecycle(monkeypatch, *abstract_socket)
    assert msgs[0] == "READY=1"
    assert msgs.count("WATCHDOG=1") >= 2
    assert msgs[-1] == "STOPPING=1"


def test_unhealthy_daemon_sends_status_but_no_watchdog(path_socket: tuple[str, Receiver]) -> None:
    address, receiver = path_socket
    notifier = Notifier(address, watchdog_usec=100_000)
    healthy = threading.Event()
    beat = Heartbeat(notifier, healthy=healthy.is_set, status=lambda: "stuck", interval=0.02)
    beat.start()
    receiver.wait_for(lambda m: m.count("STATUS=stuck") >= 3)
    assert "WATCHDOG=1" not in receiver.snapshot()
    healthy.set()
    receiver.wait_for(lambda m: "WATCHDOG=1" in m)
    beat.stop()


def test_failing_callbacks_do_not_kill_the_heartbeat(path_socket: tuple[str, Receiver]) -> None:
    address, receiver = path_socket

    def broken_status() -> str:
        raise RuntimeError("boom")

    beat = Heartbeat(Notifier(address), healthy=lambda: True, status=broken_status, interval=0.02)
    beat.start()
    receiver.wait_for(lambda m: m.count("WATCHDOG=1") >= 2)
    beat.stop()


def test_no_notify_socket_is_a_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.setenv("WATCHDOG_USEC", "200000")
    notifier = Notifier.from_env()
    assert not notifier.enabled
    assert notifier.ready() is False
    assert notifier.watchdog() is False
    assert notifier.watchdog_interval() is None


def test_watchdog_pid_must_be_ours() -> None:
    env = {"NOTIFY_SOCKET": "/nonexistent", "WATCHDOG_USEC": "30000000"}
    assert Notifier.from_env({**env, "WATCHDOG_PID": str(os.getpid())}).watchdog_interval() == 15.0
    assert Notifier.from_env({**env, "WATCHDOG_PID": str(os.getpid() + 1)}).watchdog_interval() is None
    assert Notifier.from_env(env).watchdog_interval() == 15.0
    assert Notifier.from_env({**env, "WATCHDOG_USEC": "junk"}).watchdog_interval() is None


def test_missing_socket_does_not_raise(tmp_path: Path) -> None:
    notifier = Notifier(str(tmp_path / "gone.sock"))
    assert notifier.ready() is False


def test_from_env_can_unset_the_variables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "n.sock"))
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    notifier = Notifier.from_env(unset=True)
    assert notifier.enabled
    assert notifier.watchdog_interval() == 0.5
    assert "NOTIFY_SOCKET" not in os.environ
    assert "WATCHDOG_USEC" not in os.environ
