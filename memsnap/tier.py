"""The memory tier: where CRIU dumps images (tmpfs, NUMA-bound tmpfs or DAX), with reservations."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
import secrets
import stat
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memsnap import mounts, safefs

log = logging.getLogger("memsnap.tier")

STAGING = ".staging"
INCOMING = ".incoming"


class TierFull(Exception):
    """The tier cannot hold an image of the requested size."""


class TierMountError(Exception):
    """memsnapd could not mount the tier it was told to mount (tier.mount); the message says why, on one line."""


@dataclass
class TierReservation:
    """Room held for one image until it is published or released."""

    tier: MemoryTier
    key: str
    nbytes: int
    released: bool = False

    def release(self) -> None:
        """Gives the room back (idempotent)."""
        if not self.released:
            self.tier._release(self)
            self.released = True

    def __enter__(self) -> TierReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class MemoryTier:
    """A directory on a memory-backed filesystem; each published checkpoint is one subdirectory.

    The tier root is a real directory owned by root with mode 0700 (checked at start: safefs.check_root),
    and so are .staging and .incoming: only root can put anything where CRIU writes or what gets signed.
    Everything below the root is reached through the root's dirfd (memsnap.safefs), never a path string.
    """

    def __init__(self, root: str | Path, capacity_bytes: int = 0, kind: str = "tmpfs",
                 mount: MountSpec | None = None, label: str = "memory tier") -> None:
        self.label = label  # what messages call it: "memory tier", or "spill tier (guard.spill_dir)"
        self.root = safefs.ensure_root(root, label)
        self.kind = kind
        if mount is not None:
            # tier.mount: a tmpfs of our own on the checked root (or the one an earlier run mounted there), then the
            # root is checked again: what we use is the mount's root directory, not the directory under it.
            mount_tier(self.root, mount)
            self.root = safefs.ensure_root(root, label)
        self.fs, self.mount_point = describe_mount(self.root)
        huge = self.huge_pages()
        if huge in ("within_size", "always") and host_takes_back_free_memory():
            log.warning("%s %s has huge pages (huge=%s), and this node is a VM whose host takes back the memory the "
                        "guest frees (virtio-balloon free page reporting): each 2 MiB page the tier takes has to come "
                        "back from the host first, and a dump into them took 2.6x as long as into 4 KiB pages "
                        "(bench/results/tier-huge.md). Set tier.huge_pages = \"auto\" or \"never\" here",
                        label, self.root, huge)
        if kind == "numa" and (self.fs is None or not self.fs.options.get("mpol", "").startswith("bind:")):
            log.warning("%s %s: tier.kind is numa but nothing binds its pages to a node: set tier.mount = "
                        "true, or mount a tmpfs there with mpol=bind:<node>", label, self.root)
        self._fd = safefs.open_root(self.root)
        for sub in (STAGING, INCOMING):
            s = safefs.lstat(self._fd, sub)
            if s is not None and not stat.S_ISDIR(s.st_mode):
                # Only root can write here, but a link left from before must never lead recovery outside.
                log.warning("removing %s/%s: a %s, not a directory", self.root, sub,
                            "symbolic link" if stat.S_ISLNK(s.st_mode) else "file")
                os.unlink(sub, dir_fd=self._fd)
            os.close(self._subdir(sub))
        self._capacity = capacity_bytes
        self._lock = threading.Lock()
        self._reserved: dict[str, int] = {}

    def _subdir(self, sub: str) -> int:
        """A dirfd of .staging or .incoming, created root-only 0700; refused if someone else's or a link."""
        fd = safefs.open_dir(self._fd, sub, create=True)
        s = os.fstat(fd)
        if s.st_uid != os.geteuid():
            os.close(fd)
            raise safefs.UnsafePath(f"{self.root / sub} is owned by uid {s.st_uid}, not the daemon's: remove it")
        if s.st_mode & 0o077:
            os.fchmod(fd, 0o700)
        return fd

    def describe(self) -> str:
        """What the tier lives on, for the status line: 'tmpfs mounted by memsnapd (huge=within_size)', or
        'a directory on tmpfs from tmpfs (at /dev/shm)'."""
        if self.fs is None:
            return "unknown filesystem"
        if self.mount_point:
            return self.fs.describe()
        return f"a directory on {self.fs.describe()} at {self.fs.mount_point}"

    def in_ram(self) -> bool:
        """Whether the tier's files are RAM (it lies on a tmpfs or ramfs)."""
        return self.fs is not None and self.fs.fstype in ("tmpfs", "ramfs")

    def huge_pages(self) -> str:
        """The huge= of the tmpfs the tier lies on ("never" when it shows none), "" off a tmpfs."""
        fs = self.fs
        return fs.options.get("huge", "never") if fs is not None and fs.fstype == "tmpfs" else ""

    def info(self) -> dict[str, Any]:
        """kind, fstype, mounted_by_memsnapd and huge_pages ("" off a tmpfs), for memsnap_tier_info."""
        fs = self.fs
        return {"kind": self.kind, "fstype": fs.fstype if fs else "unknown",
                "mounted_by_memsnapd": bool(fs and self.mount_point and fs.ours), "huge_pages": self.huge_pages()}

    # -- capacity ---------------------------------------------------------------
    def capacity_bytes(self) -> int:
        """Configured capacity, else the filesystem's size."""
        if self._capacity:
            return self._capacity
        st = os.fstatvfs(self._fd)
        return st.f_blocks * st.f_frsize

    def used_bytes(self) -> int:
        """Bytes held by files in the tier (published, staging and incoming)."""
        return safefs.tree_blocks_bytes(self._fd)

    def free_bytes(self) -> int:
        """Room left for new images, net of outstanding reservations."""
        st = os.fstatvfs(self._fd)
        fs_free = st.f_bavail * st.f_frsize
        if self._capacity:
            fs_free = min(fs_free, max(0, self._capacity - self.used_bytes()))
        return max(0, fs_free - self.reserved_bytes())

    def reserved_bytes(self) -> int:
        """Bytes promised to dumps and fetches in flight (reservations not yet released)."""
        with self._lock:
            return sum(self._reserved.values())

    def reserve(self, nbytes: int) -> TierReservation:
        """Holds nbytes for a dump or raises TierFull; the caller may evict and retry."""
        st = os.fstatvfs(self._fd)
        fs_free = st.f_bavail * st.f_frsize
        if self._capacity:
            fs_free = min(fs_free, max(0, self._capacity - self.used_bytes()))
        with self._lock:
            free = fs_free - sum(self._reserved.values())
            if nbytes > free:
                raise TierFull(
                    f"{self.label} {self.root} has {free >> 20} MiB free but the image needs about "
                    f"{nbytes >> 20} MiB; free space (memsnapctl evict/delete) or enlarge the tier"
                )
            key = uuid.uuid4().hex
            self._reserved[key] = nbytes
        return TierReservation(self, key, nbytes)

    def _release(self, res: TierReservation) -> None:
        with self._lock:
            self._reserved.pop(res.key, None)

    # -- layout ---------------------------------------------------------------
    def path(self, ckpt_id: str) -> Path:
        """Where a published checkpoint lives."""
        return self.root / safefs.check_name(ckpt_id)

    def has(self, ckpt_id: str) -> bool:
        """Whether a published copy exists (a real directory holding a real manifest.json)."""
        try:
            with safefs.opened(safefs.open_dir(self._fd, ckpt_id)) as d:
                s = safefs.lstat(d, "manifest.json")
        except OSError:
            return False
        return s is not None and stat.S_ISREG(s.st_mode)

    def new_staging(self, ckpt_id: str, area: str = STAGING, unique: bool = False) -> Path:
        """A fresh private directory to dump or receive into; never restorable as is.

        unique: a name of its own (<id>.<random>), for work that may run twice at once (fetches).
        """
        name = f"{ckpt_id}.{secrets.token_hex(4)}" if unique else ckpt_id
        with safefs.opened(self._subdir(area)) as a:
            safefs.rmtree(a, name)
            os.mkdir(safefs.check_name(name), 0o700, dir_fd=a)
            with safefs.opened(safefs.open_dir(a, name)) as d:
                os.fchmod(d, 0o700)
        return self.root / area / name

    def publish(self, staging: Path, ckpt_id: str) -> Path:
        """Atomically makes a complete staging directory visible under its id."""
        area = staging.parent.name
        if staging.parent.parent != self.root or area not in (STAGING, INCOMING):
            raise ValueError(f"{staging} is not a staging dir of {self.root}")
        with safefs.opened(safefs.open_dir(self._fd, area)) as a:
            safefs.rename(a, staging.name, safefs.check_name(ckpt_id), dst_dirfd=self._fd)
        safefs.fsync_dir(self._fd)
        return self.root / ckpt_id

    def remove(self, ckpt_id: str) -> int:
        """Drops a published copy and returns the bytes freed (never follows a symlink out of the tier)."""
        return safefs.rmtree(self._fd, safefs.check_name(ckpt_id))

    def discard_staging(self, ckpt_id: str) -> None:
        """Removes a half-written image (by id, or a unique staging dir by its name)."""
        for area in (STAGING, INCOMING):
            with safefs.opened(self._subdir(area)) as a:
                safefs.rmtree(a, safefs.check_name(ckpt_id))

    def discard(self, staging: Path) -> None:
        """Removes one staging dir that new_staging returned."""
        if staging.parent.parent == self.root and staging.parent.name in (STAGING, INCOMING):
            with safefs.opened(self._subdir(staging.parent.name)) as a:
                safefs.rmtree(a, safefs.check_name(staging.name))

    def staging_ids(self) -> Iterator[str]:
        """Names in .staging/.incoming (half-written images after a crash); discard_staging takes them."""
        for area in (STAGING, INCOMING):
            with safefs.opened(self._subdir(area)) as a:
                names = os.listdir(a)
            yield from names

    def published_ids(self) -> list[str]:
        """Ids of checkpoints with a published tier copy; anything else at the top (a symlink, a file) is
        listed too, so that recovery removes it."""
        return [n for n in sorted(os.listdir(self._fd)) if not n.startswith(".")]


def dir_bytes(d: Path) -> int:
    """Apparent size of the files in a directory tree."""
    with safefs.opened(os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)) as fd:
        return safefs.tree_bytes(fd)


# -- tier.mount: memsnapd mounts its own tmpfs on the tier root ------------------------------------------------
MOUNT_SOURCE = "memsnap"  # the source column of a tmpfs memsnapd mounted: how a later start (and `mount`) tells it
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 0x2, 0x4, 0x8
_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC
_PAGE = 4096


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/self/mountinfo: the mount's id, where it is, its filesystem, source and superblock
    options (name -> value; "" for a flag)."""

    mount_id: int
    mount_point: str
    fstype: str
    source: str
    options: dict[str, str]

    @property
    def ours(self) -> bool:
        """A tmpfs that memsnapd mounted (tier.mount), here or in an earlier run."""
        return self.fstype == "tmpfs" and self.source == MOUNT_SOURCE

    def describe(self) -> str:
        """E.g. 'tmpfs mounted by memsnapd (huge=within_size, mpol=bind:0, size=1048576k)'."""
        who = "mounted by memsnapd" if self.ours else f"from {self.source}"
        opts = ", ".join(f"{k}={self.options[k]}" for k in ("huge", "mpol", "size") if k in self.options)
        return f"{self.fstype} {who}" + (f" ({opts})" if opts else "")


@dataclass(frozen=True)
class MountSpec:
    """The tmpfs memsnapd mounts on the tier root (tier.mount): its size (0 = tmpfs's default, half the RAM), its
    transparent huge pages (tier.huge_pages) and the NUMA node its pages are bound to (-1 = none)."""

    capacity_bytes: int = 0
    huge_pages: str = "within_size"
    numa_node: int = -1

    def options(self) -> str:
        """The tmpfs data string for mount(2): a root-only root directory, the size, huge pages, memory policy."""
        opts = ["mode=0700", "uid=0", "gid=0"]
        if self.capacity_bytes:
            opts.append(f"size={self.capacity_bytes}")
        opts.append(f"huge={self.huge_pages}")
        if self.numa_node >= 0:
            opts.append(f"mpol=bind:{self.numa_node}")
        return ",".join(opts)

    def differences(self, m: MountEntry) -> list[str]:
        """How an existing mount differs from what this spec would mount ('huge=never, config: within_size'),
        in the kernel's own spelling of the options (tmpfs shows an option only when it is not the default)."""
        if m.fstype != "tmpfs":
            return [f"a {m.fstype} filesystem, not a tmpfs"]
        want = {"huge": self.huge_pages, "mpol": f"bind:{self.numa_node}" if self.numa_node >= 0 else "none",
                "mode": "700"}
        if self.capacity_bytes:
            want["size"] = f"{-(-self.capacity_bytes // _PAGE) * _PAGE >> 10}k"
        have = {"huge": "never", "mpol": "none", "mode": "1777", "size": "the default", **m.options}
        return [f"{k}={have[k]}, config: {v}" for k, v in want.items() if have[k] != v]


def parse_mountinfo(text: str) -> dict[int, MountEntry]:
    """The mounts of a /proc/<pid>/mountinfo text by mount id (memsnap.mounts.parse reads it)."""
    return {m.id: MountEntry(m.id, m.point, m.fstype, m.source, dict(m.options)) for m in mounts.parse(text)}


def mount_point_entry(table: dict[int, MountEntry], mount_id: int, path: str) -> MountEntry | None:
    """The mount whose root path is, if the mount holding path (mount_id, from fdinfo) is mounted right there."""
    m = table.get(mount_id)
    return m if m is not None and m.mount_point == path else None


def _mount_of(fd: int) -> tuple[MountEntry | None, bool]:
    """The mount that holds an fd's directory, and whether the directory is that mount's root (a mount point).
    By the fd (its mnt_id in fdinfo, its path as the kernel reports it), never by a path string's lookup."""
    with open(f"/proc/self/fdinfo/{fd}", encoding="ascii") as f:
        found = re.search(r"^mnt_id:\s*(\d+)", f.read(), re.M)
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        table = parse_mountinfo(f.read())
    if found is None:
        return None, False
    mount_id = int(found.group(1))
    at = mount_point_entry(table, mount_id, os.readlink(f"/proc/self/fd/{fd}"))
    return (at, True) if at is not None else (table.get(mount_id), False)


def describe_mount(root: Path) -> tuple[MountEntry | None, bool]:
    """_mount_of for a checked root directory (None when /proc cannot tell)."""
    try:
        with safefs.opened(os.open(root, _PATH_FLAGS)) as fd:
            return _mount_of(fd)
    except OSError:
        return None, False


def _hidden_by_mount(fd: int) -> list[str]:
    """What a mount on this directory would hide: any entry but an empty .staging or .incoming."""
    with safefs.opened(os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)) as d:
        names = sorted(os.listdir(d))
        hidden = []
        for n in names:
            s = safefs.lstat(d, n)
            empty = False
            if n in (STAGING, INCOMING) and s is not None and stat.S_ISDIR(s.st_mode):
                with safefs.opened(safefs.open_dir(d, n)) as sub:
                    empty = not os.listdir(sub)
            if not empty:
                hidden.append(n)
    return hidden


BALLOON = Path("/sys/bus/virtio/drivers/virtio_balloon")
_F_REPORTING = 5  # VIRTIO_BALLOON_F_REPORTING: the guest reports free pages, and the host takes them back


def host_takes_back_free_memory(balloon: Path = BALLOON) -> bool:
    """Whether a virtio balloon with free page reporting is bound here: the host then unmaps memory the guest has
    freed (in 2 MiB blocks or larger), and the guest's next use of it faults it in on the host again."""
    try:
        devices = list(balloon.glob("virtio*"))
    except OSError:
        return False
    for dev in devices:
        try:
            bits = (dev / "features").read_text().strip()
        except OSError:
            continue
        if len(bits) > _F_REPORTING and bits[_F_REPORTING] == "1":
            return True
    return False


def resolve_huge_pages(setting: str, balloon: Path = BALLOON) -> str:
    """tier.huge_pages as mounted: "auto" is within_size (writing an image into 2 MiB pages is ~5x faster:
    docs/tier.md), but never on a VM whose host takes back freed memory, where each 2 MiB page comes back from the
    host first and a dump into them took 2.6x as long as into 4 KiB pages (bench/results/tier-huge.md)."""
    if setting != "auto":
        return setting
    return "never" if host_takes_back_free_memory(balloon) else "within_size"


def mount_tier(root: Path, spec: MountSpec) -> MountEntry | None:
    """tier.mount: mounts a tmpfs (spec) on root, which safefs.ensure_root has just checked, unless root is a mount
    point already (memsnapd's own from before a restart: reused, never remounted) or holds something a mount would
    hide (then: None, and a warning). Returns the mount at root.

    The target is the checked directory itself, pinned by an O_PATH|O_NOFOLLOW fd and mounted on through
    /proc/self/fd/N with mount(2), so no path is looked up again between the check and the mount (the `mount`
    binary would canonicalize /proc/self/fd/N back into a path). Never unmounted: the images live there."""
    with safefs.opened(os.open(root, _PATH_FLAGS)) as fd:
        s = os.fstat(fd)
        if s.st_uid != os.geteuid() or s.st_mode & 0o022:
            raise safefs.UnsafePath(f"memory tier {root} changed owner or mode: refusing to mount on it")
        at, here = _mount_of(fd)
        if here and at is not None:
            diff = spec.differences(at)
            if diff:
                log.warning("memory tier %s is already a mount point (%s), not what tier.mount would mount (%s): "
                            "using it as is; to get the configured mount, stop memsnapd, drain and unmount it",
                            root, at.describe(), "; ".join(diff))
            else:
                log.info("memory tier %s: reusing the mount there (%s)", root, at.describe())
            return at
        hidden = _hidden_by_mount(fd)
        if hidden:  # (checkpoints of a run before tier.mount was on, say: a mount would hide them from recovery)
            log.warning("memory tier %s: NOT mounting a tmpfs there: it holds %d entries (%s) that the mount would "
                        "hide; using the directory as it is. To get the mount: drain and evict (or delete) them, "
                        "then restart memsnapd", root, len(hidden), ", ".join(hidden[:3]))
            return None
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mount(MOUNT_SOURCE.encode(), f"/proc/self/fd/{fd}".encode(), b"tmpfs",
                      ctypes.c_ulong(_MS_NOSUID | _MS_NODEV | _MS_NOEXEC), spec.options().encode()) != 0:
            err = ctypes.get_errno()
            hint = {errno.EPERM: "memsnapd needs CAP_SYS_ADMIN in the host's mount namespace",
                    errno.EINVAL: "is the NUMA node online (/sys/devices/system/node), the size valid, and are "
                                  "huge pages on tmpfs supported (CONFIG_TRANSPARENT_HUGEPAGE)?"}.get(err, "")
            raise TierMountError(f"cannot mount a tmpfs on memory tier {root} ({spec.options()}): "
                                 f"{os.strerror(err)}{'; ' + hint if hint else ''}; or set tier.mount = false")
    at, here = describe_mount(root)
    if at is None or not here or not at.ours:
        raise TierMountError(f"memory tier {root}: the tmpfs just mounted there is not what the path leads to now")
    log.info("memory tier %s: mounted a tmpfs there (%s)", root, spec.options())
    return at
