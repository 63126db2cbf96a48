"""Which managed job a pid belongs to: the pid a user finds with pgrep or ps is the program under the job's
init (PID 1 of the job's PID namespace), not the job's root pid that `memsnapctl run` printed.

A checkpoint of part of a PID namespace cannot work (CRIU: "Can't dump a pid namespace without the process
init"), so checkpoint, stop, kill and migrate given such a pid act on the whole job (Engine.resolve_pid,
Engine.find_job) and say so (in_job_note).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol, TypeVar

from memsnap.errors import InvalidArgument

MAX_DEPTH = 256  # ancestors walked at most (a pid chain is never that deep; a loop guard)


class JobLike(Protocol):
    """What this module reads of a job record (memsnap.catalog.JobRecord)."""

    id: str
    name: str
    pid: int
    pid_start: float
    ended: bool


J = TypeVar("J", bound=JobLike)


def job_containing(jobs: Iterable[J], pid: int) -> J | None:
    """The running job whose PID namespace holds pid, else the running job one of pid's ancestors is the root
    of (a job that made a PID namespace of its own inside, or one without its own); None when pid is in none.

    A job whose root is not the init of a namespace of its own (a restored unmanaged process) matches only by
    ancestry: its namespace is the host's, which holds every process."""
    from memsnap import proc

    live = {j.pid: j for j in jobs if not j.ended and proc.alive(j.pid, j.pid_start)}
    if not live or pid in live:
        return live.get(pid)
    ns = _pidns(pid)
    if ns is not None:
        for j in live.values():
            if _pidns(j.pid) == ns and proc.in_own_pidns(j.pid):
                return j
    p = pid
    for _ in range(MAX_DEPTH):
        p = _ppid(p)
        if p <= 1:
            return None
        if p in live:
            return live[p]
    return None


def in_job_note(target: str, job_id: str, job_name: str, job_pid: int, done: str) -> str:
    """'pid 24710 is in job job-ab12cd34 (train): checkpointed the whole job' when target is a pid other than
    the job's root, else "" (done: what happened to the job)."""
    target = target.strip()
    if not (target.isascii() and target.isdigit()) or not job_id or int(target) == job_pid:
        return ""
    return f"pid {target} is in job {job_id} ({job_name or job_id}): {done} the whole job"


def note_for_target(jobs: Iterable[J], target: str, may_see: Callable[[J], bool], done: str) -> str:
    """in_job_note for a target that is a pid inside a running job the caller may see (may_see), else "";
    for an answer that does not carry the job (MigrateResponse.note)."""
    target = target.strip()
    if not (target.isascii() and target.isdigit()) or int(target) >= 1 << 22:
        return ""
    job = job_containing(jobs, int(target))
    return in_job_note(target, job.id, job.name, job.pid, done) if job is not None and may_see(job) else ""


def _pidns(pid: int) -> tuple[int, int] | None:
    """(device, inode) of pid's PID namespace, None when unreadable."""
    try:
        st = os.stat(f"/proc/{pid}/ns/pid")
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _ppid(pid: int) -> int:
    """pid's parent (0 when gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


__all__ = ["in_job_note", "job_containing", "note_for_target"]


# PF_KTHREAD in /proc/PID/stat's flags field.
_PF_KTHREAD = 0x00200000


def refuse_uncheckpointable(pid: int) -> None:
    """Refuses, before any work, what memsnap must never dump: PID 1, kernel threads, this daemon and its
    ancestors (dumping one would freeze the daemon itself, or the whole system)."""
    if pid == 1:
        raise InvalidArgument("pid 1 is the system's init: memsnap never checkpoints it")
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        flags = int(stat.rsplit(")", 1)[1].split()[6])
    except (OSError, IndexError, ValueError):
        flags = 0
    if pid == 2 or flags & _PF_KTHREAD:
        raise InvalidArgument(f"pid {pid} is a kernel thread: memsnap cannot checkpoint it")
    try:
        tgid = next((int(ln.split()[1]) for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
                     if ln.startswith("Tgid:")), pid)
    except (OSError, ValueError, IndexError):
        tgid = pid
    if tgid != pid:
        raise InvalidArgument(f"{pid} is a thread of process {tgid}: pass the process id")
    me = os.getpid()
    ancestors = set()
    p = me
    while p > 1 and p not in ancestors:
        ancestors.add(p)
        try:
            p = os.getppid() if p == me else int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    if pid in ancestors:
        what = "memsnapd itself" if pid == me else "an ancestor of memsnapd"
        raise InvalidArgument(f"pid {pid} is {what}: memsnap never checkpoints the daemon's own tree")
