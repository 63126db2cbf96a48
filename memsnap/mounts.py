"""Which mounts of a job's own mount namespace go into its image (the rest CRIU leaves out: skip_mnt).

A job with a mount namespace (its own /proc, its private /tmp) starts with a copy of the host's mounts, and
host mounts made later reach it too (its mounts are slaves of ours). CRIU records every mount of the namespace:
a host mount (a bind of one of ours) as external, to be bound back from the same path on restore; any other
mount with its contents (a tmpfs as a tarball). So a restore failed when a host mount the job never used was gone
by then (a container runtime's /run/netns/netns-*, a tier tmpfs, a volume), and a move failed on a node without
the source's mounts. What the image keeps:

    /, /run, /run/lock, /tmp, /var/tmp          the places programs expect on every node
    /dev, /sys, /proc and every mount below     the system's own
    the job's private /tmp (PRIVATE_TMP_SOURCE)  with its contents: a job's temp files travel with it
    the job log's bind mount there (JOB_LOG)     external: each restore binds a new log there
    every mount the job uses                     an open file, a mapping, its cwd, root or executable on it
    the mounts above each kept one

Everything else is left out: the restored namespace simply lacks it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

# The source of the tmpfs a job gets as its private /tmp (memsnap.jobs): told apart from a host's tmpfs.
PRIVATE_TMP_SOURCE = "memsnap-tmp"
# Where a job with a private /tmp finds its log: the node's log file bound onto this path (memsnap.jobs). The
# image records that bind mount as external under LOG_MOUNT_KEY, and a restore binds a new log file there.
JOB_LOG = "/tmp/.memsnap/log"
LOG_MOUNT_KEY = "memsnap-log"
_ALWAYS = {"/", "/run", "/run/lock", "/tmp", "/var/tmp"}
_SYSTEM_TREES = ("/dev", "/sys", "/proc")


@dataclass(frozen=True)
class Mount:
    """One line of /proc/PID/mountinfo."""

    id: int
    parent: int
    dev: str  # "major:minor" of the superblock
    root: str  # the path inside its filesystem that is mounted here
    point: str  # where, in the namespace's view
    fstype: str
    source: str
    options: tuple[tuple[str, str], ...] = ()  # the superblock's options: (name, value; "" for a flag)


def _unescape(field: str) -> str:
    """A mountinfo path: the kernel writes space, tab, newline and backslash as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse(text: str) -> list[Mount]:
    """The mounts of a mountinfo text (lines it cannot read are skipped)."""
    out = []
    for line in text.splitlines():
        pre, sep, post = line.partition(" - ")
        f, g = pre.split(), post.split()
        if not sep or len(f) < 5 or len(g) < 2:
            continue
        opts = tuple((k, v) for k, _, v in (o.partition("=") for o in g[2].split(","))) if len(g) > 2 else ()
        try:
            out.append(Mount(int(f[0]), int(f[1]), f[2], _unescape(f[3]), _unescape(f[4]), g[0], _unescape(g[1]),
                             opts))
        except ValueError:
            continue
    return out


def mountinfo(pid: int | str) -> list[Mount]:
    """The mounts pid sees."""
    return parse(Path(f"/proc/{pid}/mountinfo").read_text(errors="surrogateescape"))


def _under(path: str, point: str) -> bool:
    return point == "/" or path == point or path.startswith(point.rstrip("/") + "/")


def _holder(mounts: list[Mount], path: str) -> Mount | None:
    """The mount a path of the namespace lies on: the deepest mount point above it (the last mounted wins)."""
    best: Mount | None = None
    for m in mounts:
        if _under(path, m.point) and (best is None or len(m.point) >= len(best.point)):
            best = m
    return best


def used_mounts(pids: list[int], mounts: list[Mount]) -> set[int]:
    """Mount ids that processes of the tree use: an fd on them (fdinfo's mnt_id), or a mapping, cwd, root or
    executable below their mount point."""
    used: set[int] = set()
    for pid in pids:
        paths: list[str] = []
        try:
            for fd in os.listdir(f"/proc/{pid}/fdinfo"):
                try:
                    found = re.search(r"^mnt_id:\s*(\d+)", Path(f"/proc/{pid}/fdinfo/{fd}").read_text(), re.M)
                except OSError:
                    continue
                if found:
                    used.add(int(found.group(1)))
            for link in ("cwd", "root", "exe"):
                try:
                    paths.append(os.readlink(f"/proc/{pid}/{link}"))
                except OSError:
                    pass
            for line in Path(f"/proc/{pid}/maps").read_text(errors="surrogateescape").splitlines():
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith("/"):
                    paths.append(parts[5].removesuffix(" (deleted)"))
        except OSError:
            continue  # (gone meanwhile)
        for p in paths:
            m = _holder(mounts, p)
            if m is not None:
                used.add(m.id)
    return used


def left_out(mounts: list[Mount], ours: list[Mount], used: set[int]) -> list[str]:
    """Mount points of a job's namespace to leave out of its image (see the module's doc)."""
    our_binds = {(m.dev, m.root) for m in ours}

    def bind_of_ours(m: Mount) -> bool:
        return any(d == m.dev and (r == "/" or m.root == r or m.root.startswith(r.rstrip("/") + "/"))
                   for d, r in our_binds)

    by_id = {m.id: m for m in mounts}
    keep: set[int] = set()
    for m in mounts:
        system = m.point in _ALWAYS or any(_under(m.point, t) for t in _SYSTEM_TREES)
        private_tmp = (m.fstype == "tmpfs" and m.source == PRIVATE_TMP_SOURCE) or m.point == JOB_LOG
        if m.id in used or private_tmp or m.fstype == "proc" or (system and bind_of_ours(m)):
            keep.add(m.id)
    for mid in list(keep):  # and the mounts above each kept one
        seen: set[int] = set()
        parent = by_id[mid].parent
        while parent in by_id and parent not in seen:
            seen.add(parent)
            keep.add(parent)
            parent = by_id[parent].parent
    # Every one by name: CRIU leaves out just the mounts named, not those below them.
    return [m.point for m in mounts if m.id not in keep and m.point != "/"]


def has_job_log(pid: int) -> bool:
    """Whether pid's namespace has the job log bind mount (a job started with a private /tmp)."""
    try:
        return any(m.point == JOB_LOG for m in mountinfo(pid))
    except OSError:
        return False


def to_leave_out(pids: list[int]) -> list[str]:
    """left_out() for the tree whose processes are pids (the first is its root), against our own mounts."""
    mounts = mountinfo(pids[0])
    return left_out(mounts, mountinfo("self"), used_mounts(pids, mounts))
