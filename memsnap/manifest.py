"""Checkpoint manifests: the file list with sizes and checksums, signed with the node's HMAC key."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path
from typing import Any

import blake3

MANIFEST = "manifest.json"
FORMAT = 1
_CHUNK = 8 << 20
# CRIU itself leaves these in the images dir on restore; they are never read back.
_CRIU_WRITES_ON_RESTORE = {"stats-restore"}


class IntegrityError(Exception):
    """An image does not match its signed manifest."""


def file_blake3(path: Path) -> str:
    """Hex blake3 of a file, hashed with several threads for big page images."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size >= _CHUNK:
            # mmap-free whole-file update keeps the multithreaded path effective.
            h.update_mmap(path)
            return h.hexdigest()
        h.update(f.read())
    return h.hexdigest()


def describe_files(images_dir: Path) -> dict[str, dict[str, Any]]:
    """Name -> {size, blake3} for every image file (the manifest itself excluded)."""
    out: dict[str, dict[str, Any]] = {}
    for p in sorted(images_dir.iterdir()):
        if p.name == MANIFEST or not p.is_file():
            continue
        out[p.name] = {"size": p.stat().st_size, "blake3": file_blake3(p)}
    return out


def load_or_create_key(path: Path) -> bytes:
    """The node's HMAC key: created at first start with mode 0600."""
    try:
        key = path.read_bytes()
        if len(key) >= 32:
            return key
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = secrets.token_bytes(32)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, key)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    return key


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign(body: dict[str, Any], key: bytes) -> dict[str, Any]:
    """Adds an HMAC-SHA256 signature over the canonical JSON of the body."""
    body = {k: v for k, v in body.items() if k != "signature"}
    body["format"] = FORMAT
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
    """Makes every image file 0600 and fsyncs it, then writes manifest.json (fsync is cheap on tmpfs)."""
    for p in images_dir.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fchmod(fd, 0o600)
                os.fsync(fd)
            finally:
                os.close(fd)
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    fd = os.open(images_dir / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(images_dir, os.O_DIRECTORY | os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def read(images_dir: Path) -> dict[str, Any]:
    """Parses manifest.json, or raises IntegrityError."""
    try:
        raw = (images_dir / MANIFEST).read_bytes()
        data = json.loads(raw)
    except FileNotFoundError as exc:
        raise IntegrityError(f"integrity check failed: {images_dir} has no manifest") from exc
    except (OSError, ValueError) as exc:
        raise IntegrityError(f"integrity check failed: unreadable manifest in {images_dir}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        raise IntegrityError("integrity check failed: manifest has no file list")
    return data


def fingerprint(images_dir: Path) -> dict[str, list[int]]:
    """(inode, size, mtime_ns, ctime_ns) per file: proof a file is untouched since we hashed it.

    ctime cannot be set from userspace and moves on every write or chmod, so a matching fingerprint
    means the bytes are the ones whose hash we computed ourselves (git's index uses the same idea).
    """
    out: dict[str, list[int]] = {}
    for p in images_dir.iterdir():
        if p.is_file() and p.name != MANIFEST:
            st = p.stat()
            out[p.name] = [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    return out


def verify_dir(images_dir: Path, key: bytes, trusted: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """Checks signature, file set, sizes and checksums; returns the manifest.

    Files whose fingerprint equals `trusted` (recorded right after we hashed them) are not re-hashed.
    """
    manifest = read(images_dir)
    verify_signature(manifest, key)
    files: dict[str, Any] = manifest["files"]
    present = {p.name for p in images_dir.iterdir() if p.is_file() and p.name != MANIFEST}
    extra = present - set(files) - _CRIU_WRITES_ON_RESTORE
    if extra:
        raise IntegrityError(f"integrity check failed: unexpected files {sorted(extra)[:3]}")
    for name, meta in files.items():
        if "/" in name or name.startswith("."):
            raise IntegrityError(f"integrity check failed: bad file name {name!r} in manifest")
        p = images_dir / name
        try:
            size = p.stat().st_size
        except FileNotFoundError as exc:
            raise IntegrityError(f"integrity check failed: {name} is missing") from exc
        if size != meta.get("size"):
            raise IntegrityError(f"integrity check failed: {name} has {size} bytes, manifest says {meta.get('size')}")
        if trusted is not None and trusted.get(name) == [*_fp(p)]:
            continue
        if file_blake3(p) != meta.get("blake3"):
            raise IntegrityError(f"integrity check failed: checksum mismatch in {name}")
    return manifest


def verify_dir_signature_only(images_dir: Path, key: bytes) -> dict[str, Any]:
    """The signed manifest of a tier copy; file hashes are checked by whoever streams the files."""
    m = read(images_dir)
    verify_signature(m, key)
    return m


def _fp(p: Path) -> tuple[int, int, int, int]:
    st = p.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns
