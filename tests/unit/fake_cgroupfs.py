"""A fake cgroupfs for the guard's fast tests: a temp directory laid out like the v1 memory controller or the v2
unified hierarchy, that memsnap.guard.cgroups.CgroupV1/CgroupV2 are pointed at (GuardConfig.cgroup_root), with the
kernel's side of it as methods: a job cgroup's files as mkdir makes them, its usage, reaching its limit, and the
eventfd notification that a v1 watcher registered through cgroup.event_control.

What a plain directory cannot do like the kernel (the tests do not depend on it):
- a control file is a regular file: a write replaces its text (writing "1" to memory.oom_control reads back
  "oom_kill_disable 1 ..." from the kernel, "1" here: oom_kill_disable() reads both);
- cgroup.event_control keeps only the last registration (the kernel keeps them all): a test that needs one watcher
  fires the last one registered;
- a job cgroup's control files are real files, so its rmdir fails (EBUSY-like): the guard's remove() is a no-op;
- poll() reports a regular file readable at once, so a v2 memory.events watcher "fires" at every poll: only
  step-driven tests (no loop thread) use v2.
"""

from __future__ import annotations

import os
from pathlib import Path

PARENT = "memsnap"  # GuardConfig.cgroup_parent's default
NO_LIMIT_V1 = 9223372036854771712  # what a v1 memory.limit_in_bytes reads when unlimited


class FakeCgroupFs:
    """A cgroup v1 memory controller (version 1) or a v2 unified root (version 2) under tmp."""

    def __init__(self, tmp: Path, version: int) -> None:
        assert version in (1, 2)
        self.version = version
        self.root = tmp / f"cgroupfs-v{version}"
        self.root.mkdir()
        parent = self.root / PARENT
        parent.mkdir()
        if version == 1:
            _files(self.root, {"memory.limit_in_bytes": f"{NO_LIMIT_V1}\n", "memory.usage_in_bytes": "0\n",
                               "memory.use_hierarchy": "1\n"})
            _files(parent, {"memory.use_hierarchy": "1\n", "cgroup.procs": ""})
        else:
            _files(self.root, {"cgroup.controllers": "cpuset cpu io memory pids\n", "cgroup.subtree_control": ""})
            _files(parent, {"cgroup.subtree_control": "", "cgroup.procs": ""})

    def job(self, name: str) -> Path:
        """The job cgroup <root>/memsnap/<name> with the files the kernel's mkdir gives it (no limit yet)."""
        cg = self.root / PARENT / name
        cg.mkdir()
        if self.version == 1:
            _files(cg, {"memory.limit_in_bytes": f"{NO_LIMIT_V1}\n", "memory.usage_in_bytes": "0\n",
                        "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n",
                        "memory.pressure_level": "", "cgroup.event_control": "", "cgroup.procs": ""})
        else:
            _files(cg, {"memory.max": "max\n", "memory.high": "max\n", "memory.current": "0\n",
                        "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n", "memory.oom.group": "0\n",
                        "memory.pressure": "", "cgroup.procs": "", "cgroup.subtree_control": ""})
        return cg

    # -- what the guard wrote ------------------------------------------------------------------------------
    def limit(self, cg: Path) -> int:
        """The job's limit: v1 memory.limit_in_bytes, v2 memory.high (memory.max is limit + a margin)."""
        return int((cg / ("memory.limit_in_bytes" if self.version == 1 else "memory.high")).read_text())

    def hard_max(self, cg: Path) -> int:
        """v2 memory.max."""
        return int((cg / "memory.max").read_text())

    def oom_kill_disable(self, cg: Path) -> int:
        """v1: whether OOM kill is off in the cgroup (the guard writes "1"; the kernel's own text has the key)."""
        text = (cg / "memory.oom_control").read_text().strip()
        if text in ("0", "1"):
            return int(text)
        return int(dict(line.split() for line in text.splitlines()).get("oom_kill_disable", "0") == "1")

    def registration(self, cg: Path) -> tuple[int, int, str]:
        """v1: the last watcher registered through cgroup.event_control: (eventfd, watched file's fd, argument)."""
        efd, ofd, *arg = (cg / "cgroup.event_control").read_text().split()
        return int(efd), int(ofd), " ".join(arg)

    # -- the kernel's side ---------------------------------------------------------------------------------
    def use(self, cg: Path, usage: int) -> None:
        """The job's tasks now charge usage bytes."""
        _replace(cg / ("memory.usage_in_bytes" if self.version == 1 else "memory.current"), f"{usage}\n")

    def reach_limit(self, cg: Path) -> None:
        """The job's tasks charge all of the limit: v1 they wait at it (under_oom 1), v2 memory.high was hit."""
        self.use(cg, self.limit(cg))
        if self.version == 1:
            disable = self.oom_kill_disable(cg)
            _replace(cg / "memory.oom_control", f"oom_kill_disable {disable}\nunder_oom 1\noom_kill 0\n")
        else:
            _replace(cg / "memory.events", "low 0\nhigh 1\nmax 0\noom 0\noom_kill 0\n")

    def notify(self, cg: Path) -> int:
        """v1: signals the eventfd last registered in the cgroup's cgroup.event_control, as the kernel does when
        its event happens; the fd. Refuses an fd of this process that is not an eventfd (a closed watcher whose
        number something else took)."""
        efd, _, _ = self.registration(cg)
        assert os.readlink(f"/proc/self/fd/{efd}") == "anon_inode:[eventfd]", f"fd {efd} is not an eventfd"
        os.eventfd_write(efd, 1)
        return efd


def _files(d: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (d / name).write_text(text)


def _replace(path: Path, text: str) -> None:
    """A kernel-side change, whole at once: the guard's loop thread may read the file meanwhile."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    os.replace(tmp, path)
