"""Processes: launching jobs in their own PID namespace, and looking at process trees."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from memsnap import jobinit


class ProcessNotFound(Exception):
    """No such process."""


class LaunchError(Exception):
    """A job could not be started."""


@dataclass
class Launched:
    """A started job: the host pid of its namespace's init and the launcher process."""

    pid: int
    pid_start: float
    launcher: subprocess.Popen[bytes]


def start_time(pid: int) -> float:
    """A process's start time, to tell a live job from a reused pid."""
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error as exc:
        raise ProcessNotFound(f"no process with pid {pid}") from exc


def alive(pid: int, pid_start: float = 0.0) -> bool:
    """Whether pid runs (and, if pid_start is given, is the same process)."""
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        return not pid_start or abs(p.create_time() - pid_start) < 0.05
    except psutil.Error:
        return False


def owner_uid(pid: int) -> int:
    """The real uid of a process."""
    try:
        return int(psutil.Process(pid).uids().real)
    except psutil.Error as exc:
        raise ProcessNotFound(f"no process with pid {pid}") from exc


def tree(pid: int) -> list[psutil.Process]:
    """The process and its descendants."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error as exc:
        raise ProcessNotFound(f"no process with pid {pid}") from exc


def tree_rss(pid: int) -> int:
    """Resident bytes of a tree: the basis of the tier reservation."""
    total = 0
    for p in tree(pid):
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def cmdline(pid: int) -> list[str]:
    """A process's argv (empty when unreadable)."""
    try:
        return list(psutil.Process(pid).cmdline())
    except psutil.Error:
        return []


def is_session_leader(pid: int) -> bool:
    """Whether the process leads its own session (else CRIU needs shell_job)."""
    try:
        return os.getsid(pid) == pid
    except OSError as exc:
        raise ProcessNotFound(f"no process with pid {pid}") from exc


def in_own_pidns(pid: int) -> bool:
    """Whether pid is the init of a PID namespace other than ours."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    ids = line.split()[1:]
                    return len(ids) > 1 and ids[-1] == "1"
    except OSError:
        pass
    return False


def kill_tree(pid: int, timeout: float = 10.0) -> None:
    """SIGKILLs a tree (its PID namespace goes with its init) and waits until the pid is gone."""
    procs = []
    try:
        procs = tree(pid)
    except ProcessNotFound:
        return
    for p in reversed(procs):
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    wait_gone(pid, timeout)


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    """Waits (bounded) until pid is no longer running; a lingering zombie counts as gone."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.01)
    return False


def wait_pid_free(pid: int, timeout: float = 10.0) -> bool:
    """Waits until pid is fully reaped, so that a restore can take it again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{pid}"):
            return True
        time.sleep(0.01)
    return False


class Launcher:
    """Starts jobs as `unshare --pid --fork setsid CMD`, so each job is init of its own PID namespace.

    The job is not our child (unshare is, in its own session), so stopping or killing the
    daemon does not take it down; a thread reaps the unshare processes while we run.
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._unshare = shutil.which("unshare") or "/usr/bin/unshare"
        self._setsid = shutil.which("setsid") or "/usr/bin/setsid"
        self._setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
        self._children: list[subprocess.Popen[bytes]] = []
        self._lock = threading.Lock()

    def launch(self, job_id: str, argv: list[str], uid: int, gid: int, cwd: str | None,
               env: dict[str, str] | None) -> tuple[Launched, Path]:
        """Starts argv as uid:gid, logging to log_dir/<job_id>.log."""
        if not argv:
            raise LaunchError("no command given; usage: memsnapctl run -- CMD ARGS...")
        log_path = self.log_dir / f"{job_id}.log"
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        if uid:
            os.fchown(fd, uid, gid)
        full_env = {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), **(env or {})}
        full_env["MEMSNAP_JOB"] = job_id
        full_env["MEMSNAP_JOB_LOG_FD"] = str(fd)
        # unshare needs root (CLONE_NEWPID); privileges are dropped inside the namespace with setpriv.
        # The log fd (opened here, as root, in the 0700 state dir) is handed down and becomes the job's
        # stdout/stderr only in the job itself, so unshare's own messages go to a separate launcher log.
        cmd = [self._unshare, "--pid", "--fork", "--"]
        if uid:
            cmd += [self._setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"]
        # bash, not sh: dash cannot redirect to fd numbers above 9.
        cmd += [self._setsid, "--", "/bin/bash", "-c",
                'n=$MEMSNAP_JOB_LOG_FD; unset MEMSNAP_JOB_LOG_FD; exec "$@" >&"$n" 2>&"$n" {n}>&-',
                "memsnap-job", *jobinit.wrap(argv)]  # PID 1 is a tiny init that passes signals on
        launcher_log = os.open(self.log_dir / f"{job_id}.launcher.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                               0o600)
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=launcher_log,
                stderr=launcher_log,
                cwd=cwd or "/",
                env=full_env,
                start_new_session=True,
                close_fds=True,
                pass_fds=(fd,),
            )
        except OSError as exc:
            raise LaunchError(f"cannot start {argv[0]}: {exc.strerror}") from exc
        finally:
            os.close(fd)
            os.close(launcher_log)
        pid = self._find_child(proc)
        with self._lock:
            self._children.append(proc)
        return Launched(pid=pid, pid_start=start_time(pid), launcher=proc), log_path

    @staticmethod
    def _find_child(proc: subprocess.Popen[bytes]) -> int:
        """The host pid of the namespace's init: unshare's only child, once setsid exec'd the command."""
        deadline = time.monotonic() + 10
        parent = psutil.Process(proc.pid)
        while time.monotonic() < deadline:
            kids = parent.children()
            if kids:
                return int(kids[0].pid)
            if proc.poll() is not None:
                raise LaunchError(f"job exited at once with status {proc.returncode}; see its log")
            time.sleep(0.002)
        raise LaunchError("job did not start within 10 s")

    def reap(self) -> None:
        """Collects exited unshare processes (called periodically)."""
        with self._lock:
            self._children = [p for p in self._children if p.poll() is None]
