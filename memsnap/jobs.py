"""Launching jobs in their own PID namespace, as their owner (Launcher); /proc helpers are memsnap.proc."""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from memsnap import jobinit, quiesce
from memsnap.mounts import JOB_LOG, PRIVATE_TMP_SOURCE
from memsnap.proc import (
    ProcessNotFound,
    alive,
    caller_groups,
    cmdline,
    in_own_pidns,
    is_session_leader,
    kill_tree,
    owner_uid,
    start_time,
    tree,
    tree_rss,
    wait_gone,
    wait_pid_free,
)


class LaunchError(Exception):
    """A job could not be started."""


@dataclass
class Launched:
    """A started job: the host pid of its namespace's init and the launcher process."""

    pid: int
    pid_start: float
    launcher: subprocess.Popen[bytes]


# The root processes of a launch (unshare, setpriv) get only this environment: nothing the caller sends
# reaches them (LD_PRELOAD and the like would run as root).
ROOT_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}

# Run as root in a job's new mount namespace (its own /proc, its private /tmp), before setpriv (python -I -S:
# no shell, and only ROOT_ENV, so nothing the caller sends runs as root): the files the job holds must be
# opened inside that namespace (CRIU cannot dump an fd on a mount of another namespace). argv: LOG_PATH LOG_FD
# TMP -- CMD... With TMP "private", a tmpfs of its own goes on /tmp (mode 1777, like the host's), and the job
# log is bound onto JOB_LOG there (memsnap.mounts): its output goes through that mount, which a restore or a
# move points at a new log of the node's own. stdin and the log are reopened at the same fd numbers; then CMD.
_SETUP_MNTNS = """import ctypes, os, sys
path, fd, tmp = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if tmp == "private":
    libc = ctypes.CDLL(None, use_errno=True)
    def mount(src, dst, fstype, flags, data):
        if libc.mount(src, dst, fstype, flags, data) != 0:
            sys.exit(f"memsnap: cannot mount {dst.decode()} for the job: " + os.strerror(ctypes.get_errno()))
    log = os.open(path, os.O_PATH | os.O_NOFOLLOW)
    mount(b"@SOURCE@", b"/tmp", b"tmpfs", 0x2 | 0x4, b"mode=1777")
    os.mkdir(os.path.dirname("@LOG@"), 0o755)
    os.close(os.open("@LOG@", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    mount(f"/proc/self/fd/{log}".encode(), b"@LOG@", None, 0x1000, None)  # MS_BIND
    os.close(log)
    path = "@LOG@"
for p, flags, to in ((path, os.O_WRONLY | os.O_APPEND, fd), ("/dev/null", os.O_RDONLY, 0)):
    new = os.open(p, flags | os.O_NOFOLLOW)
    os.dup2(new, to)
    os.close(new)
os.execv(sys.argv[5], sys.argv[5:])
""".replace("@SOURCE@", PRIVATE_TMP_SOURCE).replace("@LOG@", JOB_LOG)

# Run as root (ROOT_ENV only) before unshare when the job has a memory limit: enters the cgroup
# (argv: CGROUP_PROCS CMD...), then execs CMD.
_ENTER_CGROUP = """import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_NOFOLLOW)
os.write(fd, str(os.getpid()).encode())
os.close(fd)
os.execv(sys.argv[2], sys.argv[2:])
"""

# Runs as the job's owner, after setpriv dropped privileges: reads the caller's environment from a
# memfd, enters the caller's cwd, becomes a session leader, points stdout/stderr at the job log, and
# execs the command. It reports "ok" (or why not) on a status pipe just before exec.
# argv: ENV_FD LOG_FD STATUS_FD CWD N INIT(N words) CMD ARGS... (INIT, if any, runs CMD as its child)
_TRAMPOLINE = r"""
import os, sys
env_fd, log_fd, st_fd = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
cwd, n_init = sys.argv[4], int(sys.argv[5])
init, argv = sys.argv[6:6 + n_init], sys.argv[6 + n_init:]
def fail(msg):
    os.write(st_fd, ("err " + msg + "\n").encode("utf-8", "replace"))
    os._exit(127)
data = b""
while True:
    b = os.read(env_fd, 1 << 16)
    if not b:
        break
    data += b
os.close(env_fd)
env = {}
for kv in data.split(b"\0"):
    if kv:
        k, _, v = kv.partition(b"=")
        env[k.decode("utf-8", "surrogateescape")] = v.decode("utf-8", "surrogateescape")
try:
    os.chdir(cwd)
except OSError as e:
    fail(f"cannot enter {cwd} as uid {os.getuid()}: {e.strerror}")
exe = argv[0]
if "/" not in exe:
    path = env.get("PATH", os.defpath)
    for d in path.split(os.pathsep):
        c = os.path.join(d or ".", exe)
        if os.path.isfile(c) and os.access(c, os.X_OK):
            exe = c
            break
    else:
        fail(f"{argv[0]}: command not found in PATH")
elif not os.access(exe, os.X_OK) or not os.path.isfile(exe):
    fail(f"{exe}: not an executable file for uid {os.getuid()}")
os.setsid()
os.dup2(log_fd, 1)
os.dup2(log_fd, 2)
os.close(log_fd)
os.write(st_fd, b"ok\n")
os.close(st_fd)
try:
    if init:  # the init (PID 1) runs the command, found above, as its child
        os.execve(init[0], [*init, exe, *argv[1:]], env)
    os.execve(exe, argv, env)
except OSError as e:
    os.write(2, f"memsnap: cannot execute {exe}: {e.strerror}\n".encode())
    os._exit(126)
"""


class Launcher:
    """Starts jobs as `unshare --pid --fork setpriv ... TRAMPOLINE CMD`, so each job is init of its own PID
    namespace and runs as its owner.

    Only unshare and setpriv run as root, with ROOT_ENV and cwd /. The caller's environment, cwd and
    command reach nothing but the trampoline, which runs after setpriv dropped to the caller's uid,
    gid and groups. The job is not our child (unshare is, in its own session), so stopping or killing
    the daemon does not take it down; a thread reaps the unshare processes while we run.
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        # 0711: a job's owner can open its own log (0600, owned by it) by name; nobody can list the dir.
        self.log_dir.mkdir(parents=True, exist_ok=True, mode=0o711)
        os.chmod(self.log_dir, 0o711)
        self._unshare = _system_tool("unshare")
        self._setpriv = _system_tool("setpriv")
        self._python = _job_python()
        self._children: list[subprocess.Popen[bytes]] = []
        self._lock = threading.Lock()

    def job_command(self, uid: int, gid: int, groups: list[int] | None, env_fd: int, log_fd: int,
                    status_fd: int, cwd: str, argv: list[str], own_proc: bool = False,
                    log_path: str = "", private_tmp: bool = False) -> list[str]:
        """The launcher's argv: root runs unshare and (for a non-root owner) setpriv; everything after
        is the owner's. A wrapper around the job command goes here, after the trampoline.

        own_proc: its own /proc; private_tmp: a tmpfs of its own on /tmp (memsnap.mounts). Either puts it in a
        mount namespace where every other mount stays the host's, as a slave, and the job's files are
        reopened inside it (still as root, with ROOT_ENV only).
        """
        mntns = ["--mount", "--propagation", "slave"] if own_proc or private_tmp else []
        cmd = [self._unshare, "--pid", "--fork", *mntns, *(["--mount-proc"] if own_proc else []), "--"]
        if mntns:
            cmd += [os.path.realpath(sys.executable), "-I", "-S", "-c", _SETUP_MNTNS, log_path, str(log_fd),
                    "private" if private_tmp else "host", "--"]
        if uid:
            cmd += [self._setpriv, f"--reuid={uid}", f"--regid={gid}"]
            cmd += [f"--groups={','.join(str(g) for g in groups)}"] if groups else ["--clear-groups"]
            cmd += ["--"]
        # PID 1 of the job is a tiny init (memsnap.jobinit) that passes signals on to the command.
        init = jobinit.wrap([])
        cmd += [self._python, "-I", "-S", "-c", _TRAMPOLINE, str(env_fd), str(log_fd), str(status_fd), cwd,
                str(len(init)), *init, *argv]
        return cmd

    def launch(self, job_id: str, argv: list[str], uid: int, gid: int, cwd: str | None,
               env: dict[str, str] | None, groups: list[int] | None = None,
               own_proc: bool = False, cgroup_procs: str = "", private_tmp: bool = False) -> tuple[Launched, Path]:
        """Starts argv as uid:gid (and groups), logging to log_dir/<job_id>.log; own_proc: with its own
        /proc, private_tmp: with a /tmp of its own (either: a mount namespace); cgroup_procs: a memory cgroup's
        cgroup.procs, which the launch enters before unshare runs, so that every process of the job is in it
        from the start (memsnap.guard)."""
        if not argv:
            raise LaunchError("no command given; usage: memsnapctl run -- CMD ARGS...")
        log_path = self.log_dir / f"{job_id}.log"
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        if uid:
            os.fchown(fd, uid, gid)
        # Where its processes may listen for quiesce requests (memsnap.quiesce), unless the caller chose.
        job_env = {quiesce.ENV_DIR: quiesce.default_dir(job_id, private_tmp), **(env or {}), "MEMSNAP_JOB": job_id}
        env_fd = os.memfd_create("memsnap-job-env", 0)
        rd, wr = os.pipe()
        launcher_log = os.open(self.log_dir / f"{job_id}.launcher.log",
                               os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        try:
            data = b"".join(k.encode() + b"=" + v.encode() + b"\0" for k, v in job_env.items())
            os.write(env_fd, data)
            os.lseek(env_fd, 0, os.SEEK_SET)
            cmd = self.job_command(uid, gid, groups, env_fd, fd, wr, cwd or "/", argv, own_proc=own_proc,
                                   log_path=str(log_path), private_tmp=private_tmp)
            if cgroup_procs:
                cmd = [os.path.realpath(sys.executable), "-I", "-S", "-c", _ENTER_CGROUP, cgroup_procs, *cmd]
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=launcher_log,
                stderr=launcher_log,
                cwd="/",
                env=dict(ROOT_ENV),
                start_new_session=True,
                close_fds=True,
                pass_fds=(fd, env_fd, wr),
            )
        except OSError as exc:
            os.close(rd)
            raise LaunchError(f"cannot start {argv[0][:200]}: {exc.strerror}") from exc
        finally:
            for f in (fd, env_fd, wr, launcher_log):
                os.close(f)
        with self._lock:
            self._children.append(proc)
        try:
            status = _read_status(rd, 10.0)
        finally:
            os.close(rd)
        if status != "ok":
            _stop_launch(proc)
            if status.startswith("err "):
                raise LaunchError(status[4:])
            raise LaunchError(f"job could not be started ({status or 'no answer'}); see "
                              f"{self.log_dir / (job_id + '.launcher.log')}")
        pid = self._find_child(proc)
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


def _system_tool(name: str) -> str:
    """A root-owned system binary (never one found through a caller-influenced PATH)."""
    for d in ("/usr/bin", "/bin", "/usr/sbin", "/sbin"):
        p = os.path.join(d, name)
        if os.access(p, os.X_OK):
            return p
    return shutil.which(name, path=ROOT_ENV["PATH"]) or f"/usr/bin/{name}"


def _job_python() -> str:
    """The interpreter of the trampoline, which runs as the job's owner: a system python3 that any user may
    run (-I -S: it needs only os and sys), else ours."""
    for p in ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"):
        try:
            st = os.stat(p)
        except OSError:
            continue
        if st.st_mode & 0o001 and st.st_uid == 0:
            return p
    return os.path.realpath(sys.executable)


def _read_status(fd: int, timeout: float) -> str:
    """The trampoline's one status line ("ok" or "err WHY"), "" at EOF or timeout."""
    buf = b""
    deadline = time.monotonic() + timeout
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        p = select.poll()  # (not select(): a daemon with more than 1024 fds open gets numbers it cannot take)
        p.register(fd, select.POLLIN)
        if not p.poll(left * 1000):
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf += chunk
    return buf.decode("utf-8", "replace").strip()[:400]


def _stop_launch(proc: subprocess.Popen[bytes]) -> None:
    """Ends a launch that failed (its trampoline exits on its own; unshare follows)."""
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait(5)


# The /proc helpers moved to memsnap.proc; these names stay importable from here for code written before.
__all__ = ["LaunchError", "Launched", "Launcher", "ROOT_ENV", "ProcessNotFound", "alive", "caller_groups", "cmdline",
           "in_own_pidns", "is_session_leader", "kill_tree", "owner_uid", "start_time", "tree", "tree_rss",
           "wait_gone", "wait_pid_free"]
