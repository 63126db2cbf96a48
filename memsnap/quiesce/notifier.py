"""memsnapd's side of the quiesce protocol (memsnap.quiesce): find a tree's listeners, ask them all at once,
wait for their answers, and tell them to resume.

Root never follows a path the job can change: the directory is walked from /proc/<pid>/root one component
at a time without following a symlink (safefs.open_path), a socket is connected through an O_PATH fd of the
entry itself, and the process listening on it must belong to the tree (SO_PEERCRED), else it is not asked.
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
from dataclasses import dataclass, field
from typing import Any

from memsnap import proc, safefs
from memsnap.errors import FailedPrecondition
from memsnap.quiesce.protocol import ENV_DIR, PROCEED, SUFFIX, VERSION, Policy, encode, read_line

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0
CLOSE_WAIT_S = 2.0  # after an answer, how long the job may take to close its end
MAX_LISTENERS = 256


class QuiesceRefused(FailedPrecondition):
    """The job refused to quiesce, or did not answer in time and its policy is to refuse."""


@dataclass
class Answer:
    """One listener's answer: ok, a refusal (error), or none (no_answer: timeout, EOF, garbage)."""

    where: str
    ok: bool = False
    error: str = ""
    no_answer: bool = False
    seconds: float = 0.0


@dataclass
class Quiesced:
    """A tree whose listeners were asked to quiesce: what they answered and how long it took."""

    root_pid: int
    ckpt_id: str
    answers: list[Answer] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def listeners(self) -> int:
        """How many listeners were asked."""
        return len(self.answers)


def _environ(pid: int) -> dict[str, str]:
    """pid's environment (what it was started with); {} when unreadable."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read(1 << 20)
    except OSError:
        return {}
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


def _peer_pid(sock: socket.socket) -> int:
    """The pid (in our pid namespace) of the process that listens on the other end."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[0])


class Quiescer:
    """Asks a tree's listeners to quiesce before a dump and tells them to resume after; never raises on resume."""

    def __init__(self, max_listeners: int = MAX_LISTENERS) -> None:
        self._max = max_listeners

    def policy(self, root_pid: int) -> tuple[Policy, dict[str, int]]:
        """The job's policy and its listener dirs (dir -> a pid whose /proc/<pid>/root reaches it)."""
        try:
            pids = [p.pid for p in proc.tree(root_pid)]
        except proc.ProcessNotFound:
            return Policy(), {}
        dirs: dict[str, int] = {}
        policy: Policy | None = None
        for pid in pids:
            env = _environ(pid)
            d = env.get(ENV_DIR, "")
            if not d:
                continue
            if policy is None:
                policy, problems = Policy.from_env(env)
                for p in problems:
                    log.warning("job pid %d: %s; using %s", root_pid, p, policy)
            if not d.startswith("/") or "\0" in d:
                log.warning("job pid %d: %s=%r is not an absolute path; not asked to quiesce", pid, ENV_DIR, d[:80])
                continue
            dirs.setdefault(d, pid)
        return policy or Policy(), dirs

    def _connect(self, root_pid: int) -> tuple[Policy, list[tuple[str, socket.socket]]]:
        """Connections to every listener of the tree (where, socket), and the job's policy."""
        policy, dirs = self.policy(root_pid)
        if not dirs:
            return policy, []
        try:
            members = {p.pid for p in proc.tree(root_pid)}
            owner = proc.owner_uid(root_pid)
        except proc.ProcessNotFound:
            return policy, []
        out: list[tuple[str, socket.socket]] = []
        for d, pid in dirs.items():
            try:
                root = os.open(f"/proc/{pid}/root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                with safefs.opened(root), safefs.opened(safefs.open_path(root, d)) as dfd:
                    for name, st in safefs.entries(dfd):
                        if len(out) >= self._max:
                            break
                        if not name.endswith(SUFFIX) or not stat.S_ISSOCK(st.st_mode) or st.st_uid not in (owner, 0):
                            continue
                        sock = self._connect_one(dfd, name, members)
                        if sock is not None:
                            out.append((f"{d.rstrip('/')}/{name}", sock))
            except FileNotFoundError:
                continue  # (the usual case: the job never opted in)
            except (OSError, ValueError, safefs.UnsafePath) as exc:  # (ValueError: a '..' in the path)
                log.warning("job pid %d: not looking for quiesce listeners in %s: %s", root_pid, d, exc)
        return policy, out

    @staticmethod
    def _connect_one(dfd: int, name: str, members: set[int]) -> socket.socket | None:
        """A connection to the socket name in dfd when a process of the tree listens on it, else None."""
        try:
            fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        except OSError:
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with safefs.opened(fd):
                sock.settimeout(CONNECT_TIMEOUT_S)
                sock.connect(safefs.fd_path(fd))
            peer = _peer_pid(sock)
        except OSError as exc:  # a stale socket file (its process is gone): nobody to ask
            log.debug("quiesce socket %s: %s", name, exc)
            sock.close()
            return None
        if peer not in members:
            log.warning("quiesce socket %s is served by pid %d, which is not in the job: not asked", name, peer)
            sock.close()
            return None
        return sock

    def _exchange(self, conns: list[tuple[str, socket.socket]], msg: dict[str, Any], timeout_s: float) -> list[Answer]:
        """Send msg to every listener at once; their answers, each awaited until the deadline."""
        deadline = time.monotonic() + timeout_s
        answers = [Answer(where) for where, _ in conns]

        def one(i: int) -> None:
            where, sock = conns[i]
            t0 = time.monotonic()
            try:
                sock.settimeout(CONNECT_TIMEOUT_S)
                sock.sendall(encode(msg))
                reply = read_line(sock, deadline)
                if reply is None:
                    answers[i].no_answer = True
                elif reply.get("ok") is True:
                    answers[i].ok = True
                    read_line(sock, min(deadline, time.monotonic() + CLOSE_WAIT_S))  # its close (EOF)
                else:
                    answers[i].error = str(reply.get("error") or "refused")[:500]
            except OSError as exc:
                answers[i].no_answer, answers[i].error = True, str(exc)
            finally:
                answers[i].seconds = time.monotonic() - t0
                sock.close()

        _each(len(conns), one)
        return answers

    def quiesce(self, root_pid: int, ckpt_id: str,
                journal: Callable[[bool], None] | None = None) -> Quiesced | None:
        """Asks every listener of the tree to quiesce and waits for their answers (the job's policy).

        None when the tree has no listener. journal(True) runs before the first request, journal(False) once
        the job is told to resume. Raises QuiesceRefused (a refusal, or no answer in time and a refusing
        policy) after telling every listener asked to resume.
        """
        t0 = time.monotonic()
        policy, conns = self._connect(root_pid)
        if not conns:
            return None
        if journal is not None:
            journal(True)
        answers = self._exchange(conns, {"memsnap": VERSION, "event": "quiesce", "checkpoint": ckpt_id,
                                         "deadline_s": policy.timeout_s}, policy.timeout_s)
        done = Quiesced(root_pid, ckpt_id, answers, time.monotonic() - t0)
        refused = [a for a in answers if not a.ok and not a.no_answer]
        silent = [a for a in answers if a.no_answer]
        if refused or (silent and policy.on_timeout != PROCEED):
            self.resume(root_pid, ckpt_id, restored=False, journal=journal)
            if refused:
                why = "; ".join(f"{a.where}: {a.error}" for a in refused)
                raise QuiesceRefused(f"job pid {root_pid} refused to quiesce for checkpoint {ckpt_id} ({why}); it "
                                     "was told to resume and was not checkpointed")
            raise QuiesceRefused(
                f"job pid {root_pid} did not acknowledge the quiesce request within {policy.timeout_s:g} s "
                f"({', '.join(a.where for a in silent)}); it was told to resume and was not checkpointed "
                "(MEMSNAP_QUIESCE_ON_TIMEOUT=proceed in its environment checkpoints it anyway)")
        if silent:
            log.warning("job pid %d: %s did not acknowledge the quiesce request within %g s; checkpointing anyway "
                        "(%s=proceed)", root_pid, ", ".join(a.where for a in silent), policy.timeout_s,
                        "MEMSNAP_QUIESCE_ON_TIMEOUT")
        return done

    def resume(self, root_pid: int, ckpt_id: str, restored: bool,
               journal: Callable[[bool], None] | None = None) -> list[Answer]:
        """Tells every listener of the tree to resume (restored: it is a copy restored from the image) and waits
        for their answers up to the job's deadline; logs what went wrong, never raises."""
        try:
            policy, conns = self._connect(root_pid)
            answers = self._exchange(conns, {"memsnap": VERSION, "event": "resume", "checkpoint": ckpt_id,
                                             "restored": restored, "deadline_s": policy.timeout_s},
                                     policy.timeout_s) if conns else []
        except Exception as exc:  # (a resume must never fail the restore or rollback it follows)
            log.error("could not tell job pid %d to resume after %s: %s", root_pid, ckpt_id, exc)
            return []
        for a in answers:
            if not a.ok:
                log.warning("job pid %d: %s did not confirm the resume after %s: %s", root_pid, a.where, ckpt_id,
                            a.error or "no answer in time")
        if journal is not None:
            journal(False)
        return answers


def _each(n: int, call: Callable[[int], None]) -> None:
    """call(i) for i in range(n), one thread each; returns when all are done."""
    threads = [threading.Thread(target=call, args=(i,), name=f"quiesce-{i}", daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
