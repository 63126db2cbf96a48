"""Per-job memory cgroups on cgroup v1 (memory controller) or v2 (unified), and their watchers.

v1: memory.limit_in_bytes, memory.oom_control (oom_kill_disable=1, so tasks wait at the limit instead of
dying; an eventfd registered through cgroup.event_control fires when they do), memory.pressure_level.
v2: memory.max is the hard limit, memory.high (set to the limit) throttles first; memory.events (its
"high"/"max"/"oom" counters; poll() reports a change as POLLPRI) and a memory.pressure trigger watch it.
"""

from __future__ import annotations

import errno
import os
import select
import time
from dataclasses import dataclass
from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup/memory")
V2_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 62


class CgroupError(Exception):
    """A cgroup could not be created, configured or read."""


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise CgroupError(f"cannot read {path}: {exc.strerror}") from exc


def _write(path: Path, value: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
    except OSError as exc:
        raise CgroupError(f"cannot open {path}: {exc.strerror}") from exc
    try:
        os.write(fd, value.encode())
    except OSError as exc:
        raise CgroupError(f"cannot write {value!r} to {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)


def _kv(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


@dataclass
class Usage:
    """One sample of a job cgroup."""

    usage: int
    limit: int
    at_limit: bool  # v1: under_oom (tasks wait at the limit); v2: memory.high was hit since the last sample
    oom_kills: int


class MemoryCgroups:
    """The memory cgroups of limited jobs: <root>/<parent>/<name>. Subclasses per cgroup version."""

    version = 0

    def __init__(self, root: Path, parent: str) -> None:
        self.root = Path(root)
        self.parent = self.root / parent

    def setup(self) -> None:
        """Creates the parent cgroup."""
        try:
            self.parent.mkdir(exist_ok=True)
        except OSError as exc:
            raise CgroupError(f"cannot create {self.parent}: {exc.strerror}") from exc

    def path(self, name: str) -> Path:
        """The cgroup of a job (name: a token, never caller input)."""
        if not name or "/" in name or name.startswith("."):
            raise CgroupError(f"bad cgroup name {name!r}")
        return self.parent / name

    def of_pid(self, pid: int) -> Path | None:
        """The job cgroup (below parent) that pid is in, or None (another cgroup, or gone)."""
        want = "memory" if self.version == 1 else ""
        try:
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            _, ctrls, rel = line.split(":", 2)
            if (want in ctrls.split(",")) if want else ctrls == "":
                cg = self.root / rel.lstrip("/")
                return cg if cg.parent == self.parent and cg.is_dir() else None
        return None

    def enter(self, cg: Path, pids: list[int]) -> None:
        """Moves pids into the cgroup."""
        for pid in pids:
            try:
                (cg / "cgroup.procs").write_text(str(pid))
            except OSError as exc:
                raise CgroupError(f"cannot move pid {pid} into {cg}: {exc.strerror}") from exc

    def create(self, name: str, limit: int) -> Path:
        """A job cgroup with the limit (and no OOM kill where the version allows)."""
        cg = self.path(name)
        try:
            cg.mkdir(exist_ok=True)
        except OSError as exc:
            raise CgroupError(f"cannot create {cg}: {exc.strerror}") from exc
        self.set_limit(cg, limit)
        return cg

    def remove(self, cg: Path) -> None:
        """Removes an empty job cgroup (a busy one stays)."""
        try:
            cg.rmdir()
        except OSError:
            pass

    def procs(self, cg: Path) -> list[int]:
        """Pids in the cgroup."""
        try:
            return [int(x) for x in _read(cg / "cgroup.procs").split()]
        except CgroupError:
            return []

    # version specific
    def set_limit(self, cg: Path, limit: int) -> None:
        raise NotImplementedError

    def sample(self, cg: Path) -> Usage:
        raise NotImplementedError

    def give_headroom(self, cg: Path, extra: int) -> int:
        """Raises the limit to usage + extra (never lowers it); returns the new limit."""
        raise NotImplementedError

    def watch(self, cg: Path) -> int:
        """An fd that poll() reports readable (POLLIN) or exceptional (POLLPRI) when the job reaches its limit."""
        raise NotImplementedError

    def ack(self, fd: int) -> None:
        """Consumes a watcher's event."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


class CgroupV1(MemoryCgroups):
    """The v1 memory controller."""

    version = 1

    def setup(self) -> None:
        super().setup()
        try:  # children account to us hierarchically (always on in recent kernels; older ones need it)
            if _read(self.parent / "memory.use_hierarchy").strip() != "1":
                _write(self.parent / "memory.use_hierarchy", "1")
        except CgroupError:
            pass

    def set_limit(self, cg: Path, limit: int) -> None:
        _write(cg / "memory.oom_control", "1")  # wait at the limit, never OOM kill
        try:
            _write(cg / "memory.limit_in_bytes", str(limit))
        except CgroupError as exc:
            # EBUSY: usage already above the new limit (a resume with a smaller limit); keep the old one
            raise CgroupError(f"{exc}; usage is {self.sample(cg).usage} bytes") from exc

    def sample(self, cg: Path) -> Usage:
        oom = _kv(_read(cg / "memory.oom_control"))
        return Usage(usage=int(_read(cg / "memory.usage_in_bytes")), limit=int(_read(cg / "memory.limit_in_bytes")),
                     at_limit=oom.get("under_oom", 0) == 1, oom_kills=oom.get("oom_kill", 0))

    def give_headroom(self, cg: Path, extra: int) -> int:
        s = self.sample(cg)
        new = max(s.limit, s.usage + extra)
        if new != s.limit:
            _write(cg / "memory.limit_in_bytes", str(new))  # waking the tasks that waited at the limit
        return new

    def watch(self, cg: Path) -> int:
        efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        ofd = os.open(cg / "memory.oom_control", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _write(cg / "cgroup.event_control", f"{efd} {ofd}")
        except CgroupError:
            os.close(efd)
            raise
        finally:
            os.close(ofd)
        return efd

    def watch_pressure(self, cg: Path, level: str = "critical") -> int:
        """An eventfd for memory.pressure_level (low, medium or critical) of a cgroup."""
        efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        pfd = os.open(cg / "memory.pressure_level", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _write(cg / "cgroup.event_control", f"{efd} {pfd} {level}")
        finally:
            os.close(pfd)
        return efd

    def ack(self, fd: int) -> None:
        try:
            os.eventfd_read(fd)
        except OSError as exc:
            if exc.errno != errno.EAGAIN:
                raise

    def describe(self) -> str:
        return f"cgroup v1 ({self.parent}; watchers: memory.oom_control eventfd with oom_kill_disable=1"


class CgroupV2(MemoryCgroups):
    """The unified hierarchy: memory.high at the limit throttles; memory.max (limit + headroom) is the hard stop
    that the guard keeps the job from reaching by parking it first."""

    version = 2

    def __init__(self, root: Path, parent: str, hard_margin: float = 0.10) -> None:
        super().__init__(root, parent)
        self.hard_margin = hard_margin
        self._events: dict[int, tuple[Path, int]] = {}

    def setup(self) -> None:
        super().setup()
        try:
            ctrl = _read(self.root / "cgroup.subtree_control").split()
            if "memory" not in ctrl:
                _write(self.root / "cgroup.subtree_control", "+memory")
            if "memory" not in _read(self.parent / "cgroup.subtree_control").split():
                _write(self.parent / "cgroup.subtree_control", "+memory")
        except CgroupError as exc:
            raise CgroupError(f"cannot enable the memory controller under {self.parent}: {exc}") from exc

    def set_limit(self, cg: Path, limit: int) -> None:
        hard = limit + max(16 << 20, int(limit * self.hard_margin))
        # raise max before high so that high <= max holds at every step, both ways
        cur_max = self._max(cg)
        if hard >= cur_max:
            _write(cg / "memory.max", str(hard))
            _write(cg / "memory.high", str(limit))
        else:
            _write(cg / "memory.high", str(limit))
            _write(cg / "memory.max", str(hard))
        try:
            _write(cg / "memory.oom.group", "1")  # if the kernel does kill, it kills the whole job, not a part
        except CgroupError:
            pass

    def _max(self, cg: Path) -> int:
        try:
            text = _read(cg / "memory.max").strip()
        except CgroupError:
            return UNLIMITED
        return UNLIMITED if text == "max" else int(text)

    def _high(self, cg: Path) -> int:
        text = _read(cg / "memory.high").strip()
        return UNLIMITED if text == "max" else int(text)

    def sample(self, cg: Path) -> Usage:
        ev = _kv(_read(cg / "memory.events"))
        usage = int(_read(cg / "memory.current"))
        high = self._high(cg)
        return Usage(usage=usage, limit=high, at_limit=usage >= high or ev.get("max", 0) > 0,
                     oom_kills=ev.get("oom_kill", 0))

    def give_headroom(self, cg: Path, extra: int) -> int:
        s = self.sample(cg)
        new = max(s.limit, s.usage + extra)
        if new > self._max(cg):
            _write(cg / "memory.max", str(new))
        _write(cg / "memory.high", str(new))
        return new

    def watch(self, cg: Path) -> int:
        """memory.events, polled for POLLPRI: the kernel notifies each change of its counters."""
        fd = os.open(cg / "memory.events", os.O_RDONLY | os.O_CLOEXEC)
        self._events[fd] = (cg, _kv(os.pread(fd, 4096, 0).decode()).get("high", 0))
        return fd

    def watch_pressure(self, cg: Path, trigger: str = "some 150000 2000000") -> int:
        """A memory.pressure trigger (stall µs within a window µs; without CAP_SYS_RESOURCE the window must be a
        multiple of 2 s); poll() reports POLLPRI when it fires."""
        fd = os.open(cg / "memory.pressure", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        os.write(fd, trigger.encode() + b"\0")
        return fd

    def ack(self, fd: int) -> None:
        os.pread(fd, 4096, 0)

    def describe(self) -> str:
        return (f"cgroup v2 ({self.parent}; watchers: memory.events POLLPRI, memory.high at the limit, "
                "memory.max = limit + margin)")


def detect(root: str = "", parent: str = "memsnap") -> MemoryCgroups | None:
    """The memory cgroup flavour this node has (v1 memory controller first, where it is mounted), or None."""
    if root:
        r = Path(root)
        if (r / "cgroup.controllers").exists():
            return CgroupV2(r, parent)
        if (r / "memory.limit_in_bytes").exists():
            return CgroupV1(r, parent)
        return None
    if (V1_ROOT / "memory.limit_in_bytes").exists():
        return CgroupV1(V1_ROOT, parent)
    try:
        if "memory" in (V2_ROOT / "cgroup.controllers").read_text().split():
            return CgroupV2(V2_ROOT, parent)
    except OSError:
        pass
    return None


def wait_stopped(pids: list[int], timeout: float) -> bool:
    """Waits until every thread of every pid is stopped (state T) or gone."""
    deadline = time.monotonic() + timeout
    pending = list(pids)
    while pending:
        still = [pid for pid in pending if not _stopped(pid)]
        pending = still
        if not pending:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def _stopped(pid: int) -> bool:
    """Whether each of pid's threads is stopped, or pid is gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] not in ("T", "t", "Z", "X"):
            return False
    return True


def poll_fds(fds: list[int], timeout: float) -> list[int]:
    """The fds among fds that have an event (POLLIN or POLLPRI) within timeout seconds."""
    if not fds:
        time.sleep(timeout)
        return []
    p = select.poll()
    for fd in fds:
        p.register(fd, select.POLLIN | select.POLLPRI)
    return [fd for fd, ev in p.poll(timeout * 1000) if ev & (select.POLLIN | select.POLLPRI | select.POLLERR)]
