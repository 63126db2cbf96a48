"""Checkpoint manifests: the file list with sizes and checksums, signed with the node's HMAC key.

Manifest is the one definition of the image format (checkpointctl's lib/metadata.go is the model). On
disk it is manifest.json: the canonical JSON of Manifest.body() plus "format" and an HMAC "signature";
the keys are the ones every memsnap since format 1 writes, so older images verify unchanged.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import secrets
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import blake3

from memsnap import safefs
from memsnap.dumphash import Hashed, stat_key
from memsnap.store.chunks import ChunkedStorage, chunked_storage, is_image_file_name
from memsnap.store.errors import BadObject, StoreError
from memsnap.store.parse import MANIFEST_MAX, NOT_AN_OBJECT, clip, is_count, load_json

MANIFEST = "manifest.json"
FORMAT = 1
# Format 2: a stored manifest of a chunked image (memsnap.store.chunks); its "storage" lists each file's chunks.
# Tier manifests stay format 1.
FORMAT_CHUNKED = 2
KNOWN_FORMATS = {1, 2}
_CHUNK = 8 << 20
# CRIU itself leaves these in the images dir on restore; they are never read back.
_CRIU_WRITES_ON_RESTORE = {"stats-restore"}


class IntegrityError(Exception):
    """An image does not match its signed manifest."""


@dataclass
class Manifest:
    """What a checkpoint image is: identity, origin, CRIU's timings and the file list (format FORMAT)."""

    id: str  # checkpoint id; with job and uid, what a restore binds the image to (check_binding)
    pid: int  # root pid of the dumped tree
    job: str
    name: str
    uid: int  # owner
    files: dict[str, dict[str, Any]]  # name -> {"size": bytes, "blake3": hex}
    argv: list[str] = field(default_factory=list)
    host: str = ""  # node that dumped it
    kernel: str = ""
    criu_version: str = ""
    memsnap_version: str = ""
    created_ms: int = 0  # unix ms
    frozen_ms: float = 0  # CRIU: the tree was frozen this long
    freezing_ms: float = 0  # CRIU: freezing it took this long
    dump_ms: float = 0  # CRIU's wall time
    own_pidns: bool = False  # the tree has its own PID namespace (restores never collide on pids)
    own_mntns: bool = False  # ... and its own mount namespace (/proc of its own)
    log_path: str = ""  # the job's output file
    gpus: list[dict[str, Any]] = field(default_factory=list)  # CUDA processes: model, uuid, device bytes
    pages_remote: bool = False  # the first half of a lazy move: the memory stayed on the source
    received_at: dict[str, Any] | None = None  # {"host", "unix_ms"} when it came from another node
    log_mount: str = ""  # the key of the job log's bind mount (memsnap.mounts.LOG_MOUNT_KEY), if it has one
    tcp_close: bool = False  # dumped without its TCP connections' state: a restore closes them
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase up to the dump (memsnap.phases)
    extra: dict[str, Any] = field(default_factory=dict)  # keys this memsnap does not know, kept as they are

    # written only when set (older readers never saw them)
    _OPTIONAL = ("pages_remote", "received_at", "log_mount", "tcp_close", "phases")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        """A manifest from its JSON (signature and format are the signer's, not part of the body)."""
        known = {f.name for f in fields(cls)} - {"extra"}
        kw = {k: v for k, v in d.items() if k in known}
        extra = {k: v for k, v in d.items() if k not in known and k not in ("signature", "format")}
        try:
            return cls(**kw, extra=extra)
        except TypeError as exc:
            raise IntegrityError(f"integrity check failed: the manifest lacks a field ({exc})") from exc

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Manifest:
        """A verified manifest's JSON, parsed where it enters (a restore of a tier copy, a stored copy): from_dict,
        and IntegrityError for a field present with a type that memsnap never writes (what a restore relies on)."""
        for k, ok in _TYPED_FIELDS.items():
            if k in d and not ok(d[k]):
                raise IntegrityError(f"integrity check failed: the manifest has a bad {k!r} ({clip(d[k], 60)!r})")
        return cls.from_dict(d)

    def body(self) -> dict[str, Any]:
        """The unsigned JSON body, with exactly the keys memsnap has always written."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name == "extra" or (f.name in self._OPTIONAL and not getattr(self, f.name)):
                continue
            out[f.name] = getattr(self, f.name)
        out.update(self.extra)
        return out

    def sign(self, key: bytes) -> dict[str, Any]:
        """The body with format and signature (see sign())."""
        return sign(self.body(), key)

    @property
    def size_bytes(self) -> int:
        """Bytes of all image files."""
        return sum(int(f["size"]) for f in self.files.values())

    def catalog_meta(self) -> dict[str, Any]:
        """What the catalog keeps of it (CheckpointRecord.meta), whichever way the image arrived."""
        meta: dict[str, Any] = {k: getattr(self, k) for k in ("argv", "host", "criu_version", "own_pidns",
                                                              "own_mntns", "log_path", "gpus", "freezing_ms")}
        if self.pages_remote:
            meta["pages_remote"] = True
        if self.log_mount:
            meta["log_mount"] = self.log_mount
        if self.phases:
            meta["phases"] = self.phases
        c = self.extra.get("container")
        if isinstance(c, dict):  # (list, show and restore name a container's checkpoints by it: memsnap.containers)
            meta["container"] = {k: str(c.get(k, ""))[:256] for k in ("runtime", "id", "name")}
        return meta


@dataclass(frozen=True)
class StoredFile:
    """Where a whole-file (format 1) stored copy keeps one file: its object, whether zstd encoded it, the hash of
    those stored bytes, and the file's own size and hash."""

    key: str
    zstd: bool
    stored_blake3: str
    size: int
    blake3: str


@dataclass(frozen=True)
class StoredManifest:
    """A checkpoint's signed manifest in the store, parsed once where it enters (StoredManifest.parse, after its
    signature was verified: memsnap.repository): the image's Manifest and where its files are stored, either
    chunked (memsnap.store.chunks.ChunkedStorage) or one object each (StoredFile)."""

    man: Manifest  # its body, less the storage section
    storage: ChunkedStorage | Mapping[str, StoredFile]
    _signed: dict[str, Any] = field(repr=False, compare=False)  # the JSON as stored (signature and all)

    @classmethod
    def parse(cls, signed: dict[str, Any]) -> StoredManifest:
        """The stored manifest of its (verified) JSON; IntegrityError for any that memsnap does not write: an
        unknown format, a field missing or of another type, a storage section that does not parse."""
        check_format(signed)
        man = Manifest.parse({k: v for k, v in signed.items() if k != "storage"})  # (id, job, ... are there)
        files = signed.get("files")
        if not isinstance(files, dict):
            raise IntegrityError("integrity check failed: stored manifest has no file list")
        for name, meta in files.items():
            if not (is_image_file_name(name) and isinstance(meta, dict) and is_count(meta.get("size"))
                    and isinstance(meta.get("blake3"), str)):
                raise IntegrityError(f"integrity check failed: bad entry {clip(name, 100)!r} in stored manifest")
        try:
            storage = chunked_storage(signed) or _whole_files(signed, files)
        except StoreError as exc:  # (ChunkError)
            raise IntegrityError(str(exc)) from exc
        return cls(man, storage, dict(signed))

    @property
    def chunked(self) -> ChunkedStorage | None:
        """Its chunked storage, None for a whole-file copy."""
        return self.storage if isinstance(self.storage, ChunkedStorage) else None

    def check_binding(self, ckpt_id: str, job: str, uid: int) -> None:
        """IntegrityError unless it is the manifest of checkpoint ckpt_id of job, owned by uid (check_binding)."""
        check_binding(self._signed, ckpt_id, job, uid)

    def tier_body(self) -> dict[str, Any]:
        """The body of the tier manifest of a copy fetched back: the signed body as stored, less its storage,
        format and signature (sign() it with the node's key)."""
        return {k: v for k, v in self._signed.items() if k not in ("storage", "format", "signature")}

    def catalog_meta(self) -> dict[str, Any]:
        """Manifest.catalog_meta, and a chunked copy's sizes in the store (a node that adopts it shows them)."""
        meta = self.man.catalog_meta()
        if self.chunked is not None:
            meta["store"] = {"format": "chunked", **self.chunked.sizes()}
        return meta


def _int64(v: object) -> bool:
    return type(v) is int and -(1 << 63) <= v < 1 << 63


def _number(v: object) -> bool:
    return _int64(v) or (type(v) is float and math.isfinite(v))


def _str(v: object) -> bool:
    return isinstance(v, str)


def _strs(v: object) -> bool:
    return isinstance(v, list) and all(isinstance(a, str) for a in v)


def _flag(v: object) -> bool:
    return isinstance(v, bool)


# The fields of a manifest whose type downstream code relies on (an adoption, a restore), when present; id, pid,
# job, name, uid and files must be (Manifest.from_dict).
_TYPED_FIELDS: dict[str, Callable[[object], bool]] = {
    "id": _str, "job": _str, "pid": _int64, "uid": _int64, "name": lambda v: v is None or isinstance(v, str),
    "created_ms": _int64, "frozen_ms": _number, "dump_ms": _number, "argv": _strs, "host": _str, "log_path": _str,
    "log_mount": _str, "own_pidns": _flag, "own_mntns": _flag, "pages_remote": _flag, "tcp_close": _flag,
    "gpus": lambda v: isinstance(v, list) and all(isinstance(g, dict) for g in v),
    "files": lambda v: isinstance(v, dict)}


def _whole_files(signed: dict[str, Any], files: dict[str, Any]) -> dict[str, StoredFile]:
    """The storage of a whole-file (format 1) stored copy: each file an object of its own, under its name."""
    st = signed.get("storage")
    sfiles = st.get("files") if isinstance(st, dict) else None
    if not isinstance(sfiles, dict) or set(sfiles) != set(files):
        raise IntegrityError("integrity check failed: stored manifest lists other files")
    out = {}
    for name, s in sfiles.items():
        zstd = isinstance(s, dict) and s.get("codec") == "zstd"
        if not isinstance(s, dict) or s.get("key") != f"{signed['id']}/{name}" + (".zst" if zstd else "") or \
                not isinstance(s.get("stored_blake3"), str):
            raise IntegrityError(f"integrity check failed: bad entry {clip(name, 100)!r} in stored manifest")
        out[name] = StoredFile(s["key"], zstd, s["stored_blake3"], files[name]["size"], files[name]["blake3"])
    return out


def file_blake3(path: Path) -> str:
    """Hex blake3 of a regular file (never through a symlink)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with safefs.opened(fd):
        return fd_blake3(fd)


def fd_blake3(fd: int) -> str:
    """Hex blake3 of an open file, hashed with several threads for big page images."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    size = os.fstat(fd).st_size
    if size >= _CHUNK:
        # The /proc/self/fd link names exactly this open file; the multithreaded mmap path stays effective.
        h.update_mmap(safefs.fd_path(fd))
        return h.hexdigest()
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, _CHUNK):
        h.update(chunk)
    return h.hexdigest()


def _open_images(images_dir: Path) -> int:
    """A dirfd of an images dir (its last component must be a real directory)."""
    try:
        return os.open(images_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise IntegrityError(f"integrity check failed: cannot open {images_dir}: {exc.strerror}") from exc


def _image_files(dfd: int, where: Path) -> dict[str, os.stat_result]:
    """name -> lstat of the image files of a dirfd (manifest excluded); anything but a regular file refused."""
    try:
        found = safefs.regular_files(dfd)
    except safefs.UnsafePath as exc:
        raise IntegrityError(f"integrity check failed: {where}: {exc}") from exc
    subdirs = [n for n, s in safefs.entries(dfd) if stat.S_ISDIR(s.st_mode)]
    if subdirs:
        raise IntegrityError(f"integrity check failed: {where} holds directory {subdirs[0]!r}")
    return {n: s for n, s in found if n != MANIFEST}


def describe_files(images_dir: Path, known: Mapping[str, Hashed] | None = None) -> dict[str, dict[str, Any]]:
    """Name -> {size, blake3} for every image file (the manifest itself excluded), each opened with
    O_NOFOLLOW from the dir's fd; a symlink, fifo or device in the dir is refused (IntegrityError).

    known: digests taken while CRIU wrote the files (memsnap.dumphash); one is used only when the file's inode,
    size, mtime and ctime are still those it was taken at, else the file is hashed here."""
    out: dict[str, dict[str, Any]] = {}
    with safefs.opened(_open_images(images_dir)) as dfd:
        for name in sorted(_image_files(dfd, images_dir)):
            with safefs.opened(_open_member(dfd, name, images_dir)) as fd:
                st = os.fstat(fd)
                h = (known or {}).get(name)
                digest = h.blake3 if h is not None and h.key == stat_key(st) else fd_blake3(fd)
                out[name] = {"size": st.st_size, "blake3": digest}
    return out


def _open_member(dfd: int, name: str, where: Path, flags: int = os.O_RDONLY) -> int:
    try:
        return safefs.open_file(dfd, name, flags)
    except FileNotFoundError as exc:
        raise IntegrityError(f"integrity check failed: {name} is missing") from exc
    except safefs.UnsafePath as exc:
        raise IntegrityError(f"integrity check failed: {where}: {exc}") from exc


def load_or_create_key(path: Path) -> bytes:
    """The node's HMAC key, created at first start: O_EXCL|O_NOFOLLOW, mode 0600 from the first byte.

    A key file that is a symlink, not root's, or readable/writable by group/others is refused
    (safefs.UnsafePath, one line saying how to fix it).
    """
    owner = os.geteuid()
    key = safefs.read_private(path, "HMAC key", owner)
    if key is not None and len(key) >= 32:
        return key
    parent = safefs.ensure_root(path.parent, "HMAC key directory", owner) if not path.parent.is_dir() \
        else path.parent
    new = secrets.token_bytes(32)
    dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    with safefs.opened(dfd):
        # A fresh, unguessable temp name: a stale or planted 'hmac.tmp' (any mode, or a symlink) plays no part.
        if key is not None:  # too short to be one of ours: replace it
            safefs.write_atomic(dfd, path.name, new, 0o600)
        elif not safefs.write_new(dfd, path.name, new, 0o600):
            # Another process created it first: use that one, so that everyone signs with the same key.
            return load_or_create_key(path)
    return new


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign(body: dict[str, Any], key: bytes, fmt: int = FORMAT) -> dict[str, Any]:
    """Adds the format and an HMAC-SHA256 signature over the canonical JSON of the body."""
    body = {k: v for k, v in body.items() if k != "signature"}
    body["format"] = fmt
    body["signature"] = hmac.new(key, _canonical(body), hashlib.sha256).hexdigest()
    return body


def verify_signature(manifest: dict[str, Any], key: bytes) -> None:
    """Raises IntegrityError unless the manifest was signed with key."""
    sig = manifest.get("signature")
    if not isinstance(sig, str):
        raise IntegrityError("integrity check failed: manifest is not signed")
    body = {k: v for k, v in manifest.items() if k != "signature"}
    want = hmac.new(key, _canonical(body), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(sig, want):
        raise IntegrityError("integrity check failed: manifest signature does not match this node's key")


def write(images_dir: Path, manifest: dict[str, Any]) -> None:
    """Makes every image file 0600 and fsyncs it (via fds opened with O_NOFOLLOW), then writes manifest.json
    atomically relative to the dir's fd (fsync is cheap on tmpfs)."""
    with safefs.opened(_open_images(images_dir)) as dfd:
        for name in _image_files(dfd, images_dir):
            with safefs.opened(_open_member(dfd, name, images_dir)) as fd:
                os.fchmod(fd, 0o600)
                os.fsync(fd)
        safefs.write_atomic(dfd, MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode(), 0o600)


def _read_at(dfd: int, images_dir: Path) -> dict[str, Any]:
    try:
        fd = safefs.open_file(dfd, MANIFEST)
    except FileNotFoundError as exc:
        raise IntegrityError(f"integrity check failed: {images_dir} has no manifest") from exc
    except OSError as exc:
        raise IntegrityError(f"integrity check failed: unreadable manifest in {images_dir}: {exc}") from exc
    try:
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MANIFEST_MAX + 1)
    except OSError as exc:
        raise IntegrityError(f"integrity check failed: unreadable manifest in {images_dir}: {exc}") from exc
    try:
        data = load_json(raw, "manifest", str(images_dir / MANIFEST), MANIFEST_MAX)
    except BadObject as exc:  # (any bytes: memsnap.store.parse)
        raise IntegrityError("integrity check failed: manifest has no file list" if exc.reason == NOT_AN_OBJECT
                             else f"integrity check failed: unreadable manifest in {images_dir}: it {exc.reason}") \
            from None
    if not isinstance(data.get("files"), dict):
        raise IntegrityError("integrity check failed: manifest has no file list")
    return data


def read(images_dir: Path) -> dict[str, Any]:
    """Parses manifest.json (a real regular file, opened with O_NOFOLLOW), or raises IntegrityError."""
    with safefs.opened(_open_images(images_dir)) as dfd:
        return _read_at(dfd, images_dir)


def fingerprint(images_dir: Path) -> dict[str, list[int]]:
    """(inode, size, mtime_ns, ctime_ns) per file: proof a file is untouched since we hashed it.

    ctime cannot be set from userspace and moves on every write or chmod, so a matching fingerprint
    means the bytes are the ones whose hash we computed ourselves (git's index uses the same idea).
    """
    with safefs.opened(_open_images(images_dir)) as dfd:
        return {name: [*_fp(s)] for name, s in _image_files(dfd, images_dir).items()}


def check_format(manifest: dict[str, Any]) -> None:
    """Raises IntegrityError unless the manifest has a format this memsnap knows."""
    # Format 2 is only ever a stored manifest of a chunked image: one without its chunk lists is not one.
    fmt = manifest.get("format")
    if type(fmt) is not int or fmt not in KNOWN_FORMATS or \
            (fmt == FORMAT_CHUNKED and not isinstance(manifest.get("storage"), dict)):
        raise IntegrityError(f"integrity check failed: manifest format {manifest.get('format')!r} is not one "
                             f"this memsnap knows ({sorted(KNOWN_FORMATS)})")


def check_binding(manifest: dict[str, Any], ckpt_id: str, job: str, uid: int) -> None:
    """Raises IntegrityError unless a (verified) manifest is the one of checkpoint ckpt_id of job, owned by uid.

    The signature proves this node (or its cluster) wrote the manifest, not for which checkpoint: without
    this, a copy of checkpoint B's signed image put in A's place would restore B when A was asked for.
    Every manifest since format 1 carries id, job and uid in its signed body, so old ones are bound too;
    one that lacks them, or has an unknown format, is refused.
    """
    check_format(manifest)
    got = (manifest.get("id"), manifest.get("job"), manifest.get("uid"))
    if got != (ckpt_id, job, uid):
        raise IntegrityError(f"integrity check failed: the signed manifest belongs to checkpoint {got[0]!r} "
                             f"(job {got[1]!r}, uid {got[2]!r}), not to {ckpt_id} (job {job!r}, uid {uid}): "
                             "the image was swapped")


def verify_dir(images_dir: Path, key: bytes, trusted: dict[str, list[int]] | None = None,
               bound_to: tuple[str, str, int] | None = None) -> Manifest:
    """Checks signature, binding to (checkpoint id, job, uid) when given, file set, sizes and checksums;
    returns the manifest, parsed (Manifest.parse). Every file is opened with O_NOFOLLOW from the dir's fd; a
    symlink, fifo or device in the dir fails the check.

    Files whose fingerprint equals `trusted` (recorded right after we hashed them) are not re-hashed.
    """
    with safefs.opened(_open_images(images_dir)) as dfd:
        raw = _read_at(dfd, images_dir)
        verify_signature(raw, key)
        if bound_to is not None:
            check_binding(raw, *bound_to)
        man = Manifest.parse(raw)
        files = man.files
        present = set(_image_files(dfd, images_dir))
        extra = present - set(files) - _CRIU_WRITES_ON_RESTORE
        if extra:
            raise IntegrityError(f"integrity check failed: unexpected files {sorted(extra)[:3]}")
        for name, meta in files.items():
            if "/" in name or name.startswith(".") or not name or name == MANIFEST or not isinstance(meta, dict):
                raise IntegrityError(f"integrity check failed: bad file name {name!r} in manifest")
            with safefs.opened(_open_member(dfd, name, images_dir)) as fd:
                st = os.fstat(fd)
                if st.st_size != meta.get("size"):
                    raise IntegrityError(f"integrity check failed: {name} has {st.st_size} bytes, manifest "
                                         f"says {meta.get('size')}")
                if trusted is not None and trusted.get(name) == [*_fp(st)]:
                    continue
                if fd_blake3(fd) != meta.get("blake3"):
                    raise IntegrityError(f"integrity check failed: checksum mismatch in {name}")
    return man


def verify_dir_signature_only(images_dir: Path, key: bytes,
                              bound_to: tuple[str, str, int] | None = None) -> dict[str, Any]:
    """The signed manifest of a tier copy (bound to (id, job, uid) when given); file hashes are checked by
    whoever streams the files."""
    m = read(images_dir)
    verify_signature(m, key)
    if bound_to is not None:
        check_binding(m, *bound_to)
    return m


def _fp(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns
