"""CRIU run inside a placeholder container (memsnap.containers): the wrapper that starts `criu swrk` in the
placeholder's cgroups and PID namespace, and the host pid of what it restored there."""

from __future__ import annotations

import os
import time

# sh -c: enter the cgroup.procs files given as "N FILE1 .. FILEN", then exec the rest of the arguments.
_ENTER_CGROUPS = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 126; shift; n=$((n-1)); done; exec "$@"'

# sh -c, run as the first process in a placeholder's PID namespace: a /proc of that namespace, then CRIU forked far
# above the pids the restored tree needs back (this shell took the next free pid, which is likely the workload's
# own: the placeholder started as its container did), and the shell gone, so that its pid is free again and
# CRIU's parent, and the restored tree's once CRIU exits, is the placeholder's init.
_CRIU_IN_PIDNS = ('mount -t proc proc /proc && echo $(($(cat /proc/sys/kernel/pid_max) - 10000)) '
                  '> /proc/sys/kernel/ns_last_pid && { "$0" "$@" & }')


def wrap(argv: list[str], pidns_fd: int, cgroup_procs: tuple[str, ...]) -> list[str]:
    """argv (criu swrk FD) run in these cgroups (entered before anything forks) and in the PID namespace that
    pidns_fd (inherited) is open on, in a mount namespace of its own with that namespace's /proc: CRIU finds its
    tasks there by their pids in the placeholder. The wrapper exits at once; CRIU goes on, the init's child."""
    return ["sh", "-c", _ENTER_CGROUPS, "sh", str(len(cgroup_procs)), *cgroup_procs,
            "nsenter", f"--pid=/proc/self/fd/{pidns_fd}", "--", "unshare", "--mount", "--propagation", "private",
            "--", "sh", "-c", _CRIU_IN_PIDNS, *argv]


def config(img_fd: int, wd_fd: int) -> str:
    """A CRIU config file's text naming the image and work dirs by CRIU's own fds: an RPC names them under
    /proc/<its client's pid>, which a CRIU inside another PID namespace cannot see."""
    return f"images-dir /proc/self/fd/{img_fd}\nwork-dir /proc/self/fd/{wd_fd}\n"


def _in_ns(pidns_fd: int) -> list[tuple[int, str, int]]:
    """(host pid, comm, pid in the namespace) of each process in the PID namespace pidns_fd is open on."""
    want, out = os.fstat(pidns_fd).st_ino, []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}/ns/pid").st_ino != want:
                continue
            comm, ns_pid = "", 0
            with open(f"/proc/{name}/status", encoding="ascii", errors="replace") as f:
                for line in f:
                    if line.startswith("Name:"):
                        comm = line.split(None, 1)[1].strip() if len(line.split()) > 1 else ""
                    elif line.startswith("State:") and line.split()[1:2] in (["Z"], ["X"]):
                        comm = ""  # (a zombie is gone but for its init's wait)
                    elif line.startswith("NSpid:"):
                        ns_pid = int(line.split()[-1])
                        break
            out.append((int(name), comm, ns_pid))
        except (OSError, ValueError):
            continue
    return out


def host_pid(ns_pid: int, pidns_fd: int) -> int:
    """The pid, in memsnapd's PID namespace, of the process that is ns_pid in the namespace pidns_fd is open on;
    0 if there is none."""
    return next((pid for pid, _comm, n in _in_ns(pidns_fd) if n == ns_pid), 0)


def criu_pid(pidns_fd: int, timeout_s: float = 5.0) -> int:
    """The host pid of the criu the wrapper started in that namespace (forked above pid_max - 10000: not one of
    the tasks it forks), once it runs; 0 if none shows up in time."""
    with open("/proc/sys/kernel/pid_max", encoding="ascii") as f:
        floor = int(f.read()) - 10000
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pid, comm, ns_pid in _in_ns(pidns_fd):
            if comm == "criu" and ns_pid > floor:
                return pid
        time.sleep(0.005)
    return 0


def wait_criu_gone(pidns_fd: int, timeout_s: float = 10.0) -> bool:
    """Waits until no criu is left in that namespace (it answers, then exits; the init reaps it)."""
    deadline = time.monotonic() + timeout_s
    while any(comm == "criu" for _pid, comm, _n in _in_ns(pidns_fd)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def enter_cgroup(procs: str, pid: int) -> None:
    """Moves pid into the cgroup whose cgroup.procs file this is (a placeholder container's); OSError if not."""
    fd = os.open(procs, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.write(fd, str(pid).encode())
    finally:
        os.close(fd)
