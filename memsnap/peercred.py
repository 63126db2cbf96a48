"""Peer-credential relay: the public Unix socket reads SO_PEERCRED and forwards to the private gRPC socket.

grpcio does not expose a Unix peer's credentials, so each accepted connection is relayed over a
socket bound to the abstract name memsnap-peer/<uid>/<gid>/<pid>/<nonce>; the servicer reads it back
from context.peer(). Only root can reach the private socket (0700 directory), so the name is trusted.
"""

from __future__ import annotations

import grp
import logging
import os
import secrets
import selectors
import socket
import stat
import struct
import threading
from pathlib import Path

log = logging.getLogger("memsnap.peercred")

_CRED = struct.Struct("3i")


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix stream socket."""
    pid, uid, gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid, gid


def bind_unix(path: Path, mode: int, group: str = "") -> socket.socket:
    """A listening Unix socket at path with the given mode (and group, if named)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    if group:
        os.chown(path, 0, grp.getgrnam(group).gr_gid)
    os.chmod(path, mode)
    sock.listen(128)
    return sock


class SocketInUse(Exception):
    """Another process answers on the socket path, or the path is not a socket."""


def remove_stale_socket(path: Path) -> None:
    """Removes a socket left by a daemon that died; never a live one, and never anything but a socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketInUse(f"{path} exists and is not a socket; remove it or choose another socket path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2)
    try:
        probe.connect(str(path))
    except OSError:
        pass  # nobody answers: stale
    else:
        raise SocketInUse(f"another process answers on {path}; stop it first, or choose another socket path")
    finally:
        probe.close()
    path.unlink()


class PeerCredRelay:
    """Accepts on the public socket and pumps bytes to the private gRPC socket, one pair per client."""

    def __init__(self, public: Path, private: Path, mode: int = 0o660, group: str = "") -> None:
        self.public, self.private = public, private
        self._listener = bind_unix(public, mode, group)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="peercred-relay", daemon=True)

    def start(self) -> None:
        """Starts accepting."""
        self._thread.start()

    def stop(self) -> None:
        """Stops accepting; open connections end when their peers close."""
        self._stop.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        try:
            self.public.unlink()
        except FileNotFoundError:
            pass

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                pid, uid, gid = peer_credentials(client)
                upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                upstream.bind(f"\0memsnap-peer/{uid}/{gid}/{pid}/{secrets.token_hex(6)}")
                upstream.connect(str(self.private))
            except OSError as exc:
                log.warning("relay: cannot serve a client: %s", exc)
                client.close()
                continue
            threading.Thread(target=_pump_pair, args=(client, upstream), daemon=True,
                             name=f"relay-{pid}").start()


def _pump_pair(a: socket.socket, b: socket.socket) -> None:
    """Copies both directions until both sides have closed."""
    sel = selectors.DefaultSelector()
    sel.register(a, selectors.EVENT_READ, b)
    sel.register(b, selectors.EVENT_READ, a)
    open_ends = 2
    try:
        while open_ends:
            for key, _ in sel.select():
                src: socket.socket = key.fileobj  # type: ignore[assignment]
                dst: socket.socket = key.data
                try:
                    data = src.recv(1 << 16)
                except OSError:
                    data = b""
                if data:
                    try:
                        dst.sendall(data)
                        continue
                    except OSError:
                        return
                sel.unregister(src)
                open_ends -= 1
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
    finally:
        sel.close()
        a.close()
        b.close()
