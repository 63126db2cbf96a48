"""Dependency-free sd_notify(3) client and a watchdog heartbeat thread."""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)
_ENV_NAMES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class Notifier:
    """Sends sd_notify datagrams to the socket named by $NOTIFY_SOCKET; no-op without one."""

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        """Wrap a notify socket address (path, or '@name' for abstract) and the watchdog period."""
        self._address = _socket_address(address) if address else None
        self._watchdog_usec = watchdog_usec
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, unset: bool = False) -> Notifier:
        """Build from NOTIFY_SOCKET/WATCHDOG_USEC/WATCHDOG_PID; unset=True hides them from child jobs."""
        env = os.environ if environ is None else environ
        notifier = cls(env.get("NOTIFY_SOCKET") or None, _watchdog_usec(env))
        if unset:
            for name in _ENV_NAMES:
                os.environ.pop(name, None)
        return notifier

    @property
    def enabled(self) -> bool:
        """True when a notify socket is configured."""
        return self._address is not None

    def notify(self, message: str) -> bool:
        """Send one raw notify message; return True if it was sent."""
        if self._address is None:
            return False
        try:
            with self._lock:
                if self._sock is None:
                    kind = socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
                    self._sock = socket.socket(socket.AF_UNIX, kind)
                self._sock.sendto(message.encode(), self._address)
        except OSError as exc:
            log.warning("sd_notify %r failed: %s", message.split("=", 1)[0], exc)
            return False
        return True

    def ready(self) -> bool:
        """Tell the service manager that startup is finished."""
        return self.notify("READY=1")

    def status(self, text: str) -> bool:
        """Set the free-form status line shown by systemctl status."""
        return self.notify("STATUS=" + text.replace("\n", " "))

    def stopping(self) -> bool:
        """Tell the service manager that shutdown has begun."""
        return self.notify("STOPPING=1")

    def watchdog(self) -> bool:
        """Send one watchdog keep-alive."""
        return self.notify("WATCHDOG=1")

    def watchdog_interval(self) -> float | None:
        """Seconds between keep-alives (half of WATCHDOG_USEC), or None when no watchdog applies."""
        if self._address is None or not self._watchdog_usec:
            return None
        return self._watchdog_usec / 2_000_000

    def close(self) -> None:
        """Close the datagram socket."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


def _socket_address(address: str) -> str | bytes:
    """Map '@name' to the abstract-namespace form; keep filesystem paths as they are."""
    if address.startswith("@"):
        return b"\0" + address[1:].encode()
    return address


def _watchdog_usec(env: Mapping[str, str]) -> int | None:
    """Parse WATCHDOG_USEC, honouring WATCHDOG_PID when it is set."""
    pid = env.get("WATCHDOG_PID")
    if pid and pid.strip() != str(os.getpid()):
        return None
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec if usec > 0 else None


class Heartbeat:
    """Background thread sending WATCHDOG=1 (while healthy) and STATUS=... every interval."""

    def __init__(
        self,
        notifier: Notifier,
        healthy: Callable[[], bool],
        status: Callable[[], str],
        interval: float,
    ) -> None:
        """Prepare a heartbeat; interval is in seconds."""
        if interval <= 0:
            raise ValueError(f"heartbeat interval must be positive, got {interval}")
        self._notifier = notifier
        self._healthy = healthy
        self._status = status
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        """Send one status update and, if healthy, one watchdog keep-alive."""
        try:
            self._notifier.status(self._status())
        except Exception:  # a broken status callback must not stop the keep-alives
            log.exception("heartbeat status callback failed")
        try:
            ok = self._healthy()
        except Exception:
            log.exception("heartbeat health callback failed")
            ok = False
        if ok:
            self._notifier.watchdog()

    def _run(self) -> None:
        """Beat until stopped."""
        while True:
            self.beat()
            if self._stop.wait(self._interval):
                return

    def start(self) -> None:
        """Start the heartbeat thread (idempotent)."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="sd-heartbeat", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop the heartbeat thread and wait for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
