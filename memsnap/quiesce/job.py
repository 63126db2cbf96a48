"""The job's side of the quiesce protocol (memsnap.quiesce): a listening socket and a thread that answers
memsnapd. Standard library only: a job imports it without memsnap's daemon dependencies.

Two ways to use it:
  * callbacks, run on the listener's thread: QuiesceListener(on_quiesce=f, on_resume=g).start(); f may
    raise to refuse the checkpoint (its message reaches memsnapctl);
  * safe points, for work that must happen on the job's own thread (torch.distributed): call requested()
    at a step boundary; when it is true (or another rank says so), quiesce, then acknowledge(), which
    answers memsnapd and blocks until it says resume, then rebuild and call resumed().
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from memsnap.quiesce.protocol import ENV_DIR, SUFFIX, encode, read_line

log = logging.getLogger(__name__)

Callback = Callable[[dict[str, Any]], None]
_REQUEST_S = 5.0  # how long a connected peer may take to send its request
_SLACK_S = 1.0  # a safe-point job answers until memsnapd's deadline, plus this


class QuiesceListener:
    """Listens on <dir>/<name>.sock ($MEMSNAP_QUIESCE_DIR by default) and answers memsnapd's requests."""

    def __init__(self, on_quiesce: Callback | None = None, on_resume: Callback | None = None, name: str = "",
                 directory: str | None = None, trusted_uids: tuple[int, ...] = (0,)) -> None:
        self.directory = directory if directory is not None else os.environ.get(ENV_DIR, "")
        self.name = name or str(os.getpid())
        self.path = os.path.join(self.directory, self.name + SUFFIX) if self.directory else ""
        self._on_quiesce, self._on_resume = on_quiesce, on_resume
        self._trusted = trusted_uids
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._mu = threading.Lock()
        self._quiesced = False
        self._requested = threading.Event()  # memsnapd asked (safe points: the job has not acknowledged yet)
        self._acked = threading.Event()
        self._resume: dict[str, Any] | None = None
        self._resume_asked = threading.Event()
        self._resumed = threading.Event()
        self.events: list[tuple[str, dict[str, Any]]] = []  # what memsnapd asked, in order (for the job's log)

    # -- setting up ------------------------------------------------------------------------------------
    def start(self) -> bool:
        """Binds the socket and starts the thread; False (and nothing started) without a directory."""
        if not self.directory:
            return False
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        st = os.lstat(self.directory)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise PermissionError(f"{self.directory} is not a directory of uid {os.getuid()}: not listening there")
        try:
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)  # left by an earlier run of this name
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.path)
        os.chmod(self.path, 0o600)
        sock.listen(8)
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="memsnap-quiesce", daemon=True)
        self._thread.start()
        return True

    def close(self) -> None:
        """Stops listening and removes the socket file."""
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
            try:
                os.unlink(self.path)
            except OSError:
                pass

    # -- safe points (the job's own thread) ------------------------------------------------------------
    def requested(self) -> bool:
        """Whether memsnapd asks this process to quiesce and it has not acknowledged yet."""
        return self._requested.is_set()

    def acknowledge(self, timeout: float | None = None) -> dict[str, Any]:
        """This process is quiesced: tells memsnapd (now, or when its request comes), then waits until it says
        resume; returns that message ({"restored": bool, ...}; {} after timeout). Call resumed() after."""
        with self._mu:
            self._quiesced = True
            self._acked.set()
        self._resume_asked.wait(timeout)
        with self._mu:
            return dict(self._resume or {})

    def resumed(self) -> None:
        """This process runs again: memsnapd's resume request gets its answer."""
        self._resumed.set()

    # -- the listener thread ---------------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            sock = self._sock
            if sock is None:
                return
            try:
                conn, _ = sock.accept()
            except OSError:
                if self._sock is None:
                    return
                time.sleep(0.05)  # (e.g. EINTR around a checkpoint): accept again
                continue
            try:
                self._handle(conn)
            except Exception as exc:  # one bad request never stops the listener
                log.warning("memsnap quiesce request failed: %s", exc)
            finally:
                conn.close()

    def _handle(self, conn: socket.socket) -> None:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        if struct.unpack("3i", creds)[1] not in self._trusted:
            return
        msg = read_line(conn, time.monotonic() + _REQUEST_S)
        if msg is None:
            return
        event = str(msg.get("event"))
        self.events.append((event, msg))
        deadline = time.monotonic() + float(msg.get("deadline_s") or 30.0) + _SLACK_S
        if event == "quiesce":
            reply = self._quiesce(msg, deadline)
        elif event == "resume":
            reply = self._resume_now(msg, deadline)
        else:
            reply = {"ok": False, "error": f"unknown event {event[:40]!r}"}
        if reply is not None:
            conn.sendall(encode(reply))

    def _quiesce(self, msg: dict[str, Any], deadline: float) -> dict[str, Any] | None:
        with self._mu:
            if self._quiesced:
                return {"ok": True}  # (already: acknowledged before the request came)
        if self._on_quiesce is not None:
            try:
                self._on_quiesce(msg)
            except Exception as exc:
                return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            with self._mu:
                self._quiesced = True
            return {"ok": True}
        self._requested.set()
        self._acked.wait(max(0.0, deadline - time.monotonic()))
        with self._mu:
            self._requested.clear()
            if self._quiesced:
                return {"ok": True}
        return None  # not in time: no answer (memsnapd applies the job's policy), and the request is withdrawn

    def _resume_now(self, msg: dict[str, Any], deadline: float) -> dict[str, Any]:
        with self._mu:
            if not self._quiesced:
                return {"ok": True}  # nothing to resume
        if self._on_resume is not None:
            try:
                self._on_resume(msg)
            except Exception as exc:
                return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        else:
            with self._mu:
                self._resume = msg
            self._resume_asked.set()
            self._resumed.wait(max(0.0, deadline - time.monotonic()))
        with self._mu:
            self._quiesced = False
            self._resume = None
            for ev in (self._acked, self._resume_asked, self._resumed, self._requested):
                ev.clear()
        return {"ok": True}
