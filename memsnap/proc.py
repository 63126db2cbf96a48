"""Looking at processes through /proc and psutil: liveness (pid + start time), owners, trees, and
stopping them. memsnap.jobs launches jobs; everything else that reads or signals a process uses this."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil


class ProcessNotFound(Exception):
    """No such process."""


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


def private_tmp_bytes(pid: int) -> int:
    """Bytes in the /tmp of pid's mount namespace when that is a tmpfs that is not ours (a job's private /tmp,
    whose files go into its image), else 0 (a container's /tmp on its rootfs stays out of the image)."""
    try:
        theirs = os.statvfs(f"/proc/{pid}/root/tmp")
        if os.stat(f"/proc/{pid}/root/tmp").st_dev == os.stat("/tmp").st_dev or not _tmpfs_at(pid, "/tmp"):
            return 0
    except OSError:
        return 0
    return (theirs.f_blocks - theirs.f_bfree) * theirs.f_frsize


def _tmpfs_at(pid: int, point: str) -> bool:
    """Whether the top mount at point in pid's mount namespace is a tmpfs."""
    fstype = ""
    with open(f"/proc/{pid}/mountinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            a = left.split()
            if len(a) > 4 and a[4] == point:
                fstype = right.split()[0] if right else ""
    return fstype == "tmpfs"


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


def caller_groups(pid: int, uid: int, gid: int) -> list[int] | None:
    """The supplementary groups of the calling process (from /proc), or None when they cannot be read or
    the pid no longer belongs to that uid:gid (it exited, and the pid was reused)."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.rstrip("\n").split(":", 1) for line in f if ":" in line)
    except OSError:
        return None
    try:
        uids = [int(x) for x in fields.get("Uid", "").split()]
        gids = [int(x) for x in fields.get("Gid", "").split()]
        groups = [int(x) for x in fields.get("Groups", "").split()]
    except ValueError:
        return None
    if not uids or not gids or uids[0] != uid or gids[0] != gid:
        return None
    return groups


def net_ns_id() -> str:
    """This process's network namespace, unique across hosts and boots: 'BOOT_ID:NETNS_INODE'."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}:{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return ""


def tcp_listeners(pid: int) -> list[int]:
    """The TCP ports the tree of pid listens on (its sockets in LISTEN state, IPv4 and IPv6)."""
    inodes: set[str] = set()
    procs = tree(pid)
    for p in procs:
        try:
            for fd in os.listdir(f"/proc/{p.pid}/fd"):
                try:
                    link = os.readlink(f"/proc/{p.pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    ports: set[int] = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and f[9] in inodes:  # 0A: TCP_LISTEN
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def resume_stopped(pid: int) -> None:
    """SIGCONT to every process of pid's tree (a tree a dump or a park left stopped)."""
    for p in tree(pid):
        try:
            p.send_signal(signal.SIGCONT)
        except Exception:  # the process may be gone already
            pass


def start_time_or_zero(pid: int) -> float:
    """pid's start time (start_time), or 0.0 when it is gone."""
    try:
        return start_time(pid)
    except ProcessNotFound:
        return 0.0


def ns_inode(pid: int, ns: str) -> int:
    """The inode of one of pid's namespaces ("net", "pid", ...)."""
    link = os.readlink(f"/proc/{pid}/ns/{ns}")  # "net:[4026532512]"
    return int(link[link.index("[") + 1:-1])


def live_children(pid: int) -> list[int]:
    """pid's children, but for zombies (an init reaps them)."""
    kids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                kids += [int(x) for x in f.read().split()]
    except OSError:
        return []
    return [k for k in kids if not _zombie(k)]


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def innermost_pid(pid: int) -> int:
    """pid as its own (innermost) PID namespace numbers it (NSpid's last field); 0 when unknown."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    return 0
