"""Store backends (posix and a real local moto S3 server) and the zstd codec."""

from __future__ import annotations

import base64
import errno
import hashlib
import io
import os
import socket
import stat
import uuid
from pathlib import Path
from typing import Any

import blake3
import pytest
from botocore.exceptions import ClientError

from memsnap.store import (
    Codec,
    PosixStore,
    S3Store,
    StoreCorrupt,
    StoreError,
    StoreFull,
    StoreNotFound,
    StoreUnavailable,
    copy_decode,
    copy_encode,
    open_store,
)
from tests.s3server import S3Server, running_s3_server, s3_server  # noqa: F401  (fixture)

MiB = 1 << 20


def _read_all(store: PosixStore | S3Store, key: str) -> bytes:
    with store.open_reader(key) as r:
        return r.read()


def _write(store: PosixStore | S3Store, key: str, data: bytes, chunk: int = 1 * MiB) -> None:
    with store.open_writer(key) as w:
        for i in range(0, len(data), chunk):
            w.write(data[i : i + chunk])
        obj = w.commit()
    assert obj.size_bytes == len(data) and obj.key == key


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


# --- posix -------------------------------------------------------------------------------------------


@pytest.fixture
def posix(tmp_path: Path) -> PosixStore:
    return PosixStore(tmp_path / "store", create=True)


def test_posix_round_trip(posix: PosixStore) -> None:
    data = os.urandom(3 * MiB + 17)
    _write(posix, "ck1/pages-1.img", data)
    _write(posix, "ck1/manifest.json", b"{}")
    assert _read_all(posix, "ck1/pages-1.img") == data
    assert posix.stat("ck1/pages-1.img") == len(data)
    assert posix.exists("ck1/manifest.json") and not posix.exists("ck1/nope")
    assert posix.list("ck1/") == ["ck1/manifest.json", "ck1/pages-1.img"]
    assert posix.list("") == posix.list("ck") == posix.list("ck1/")
    assert posix.list("ck2/") == [] and posix.list("ck1/pages") == ["ck1/pages-1.img"]
    assert posix.describe() == f"posix:{posix.root}"
    posix.check()


def test_posix_permissions(posix: PosixStore) -> None:
    old = os.umask(0o022)
    try:
        _write(posix, "ck1/sub/x.img", b"abc")
    finally:
        os.umask(old)
    assert _mode(posix.root) == 0o700
    assert _mode(posix.root / "ck1") == 0o700
    assert _mode(posix.root / "ck1/sub") == 0o700
    assert _mode(posix.root / "ck1/sub/x.img") == 0o600


def test_posix_invisible_until_commit(posix: PosixStore) -> None:
    w = posix.open_writer("ck1/manifest.json")
    w.write(b"partial")
    assert not posix.exists("ck1/manifest.json")
    assert posix.list("") == []
    with pytest.raises(StoreNotFound):
        posix.stat("ck1/manifest.json")
    with pytest.raises(StoreNotFound):
        posix.open_reader("ck1/manifest.json")
    assert len(os.listdir(posix.root / "ck1")) == 1  # the temp file
    w.commit()
    assert posix.list("") == ["ck1/manifest.json"]
    assert os.listdir(posix.root / "ck1") == ["manifest.json"]


def test_posix_abort_leaves_nothing(posix: PosixStore) -> None:
    w = posix.open_writer("ck1/a.img")
    w.write(b"x" * 1000)
    w.abort()
    w.abort()
    with posix.open_writer("ck1/b.img") as w2:
        w2.write(b"y")  # leaving the block without commit() aborts
    assert os.listdir(posix.root / "ck1") == []
    with pytest.raises(StoreError):
        w.write(b"more")


def test_posix_cleanup_temps(posix: PosixStore) -> None:
    crashed = posix.open_writer("ck1/a.img")
    crashed.write(b"half written")
    _write(posix, "ck1/b.img", b"ok")
    assert posix.list("") == ["ck1/b.img"]
    assert posix.cleanup_temps(older_than_s=3600) == 0  # still fresh: may belong to a live writer
    fresh = PosixStore(posix.root)  # as after a restart
    assert fresh.cleanup_temps() == 1
    assert os.listdir(posix.root / "ck1") == ["b.img"]


def test_posix_delete_prefix(posix: PosixStore) -> None:
    for key in ("ck1/manifest.json", "ck1/a.img", "ck1/sub/b.img", "ck10/a.img"):
        _write(posix, key, b"data")
    posix.delete_prefix("ck1/")
    assert posix.list("") == ["ck10/a.img"]
    assert not (posix.root / "ck1").exists()
    posix.delete_prefix("ck1/")  # idempotent
    with pytest.raises(ValueError):
        posix.delete_prefix("")


def test_posix_invalid_keys(posix: PosixStore) -> None:
    for key in ("", "/abs", "a/../b", "a//b", "ck1/.tmp-x"):
        with pytest.raises(ValueError):
            posix.open_writer(key)


def test_posix_unavailable_when_root_removed(posix: PosixStore) -> None:
    _write(posix, "ck1/a.img", b"data")
    os.rename(posix.root, posix.root.with_name("moved"))
    for call in (
        posix.check,
        lambda: posix.open_writer("ck1/b.img"),
        lambda: posix.open_reader("ck1/a.img"),
        lambda: posix.exists("ck1/a.img"),
        lambda: posix.list(""),
        lambda: posix.stat("ck1/a.img"),
    ):
        with pytest.raises(StoreUnavailable, match="missing: mount"):
            call()


def test_posix_root_not_created_by_default(tmp_path: Path) -> None:
    store = PosixStore(tmp_path / "absent")
    with pytest.raises(StoreUnavailable):
        store.check()
    assert not (tmp_path / "absent").exists()


def test_posix_oserror_mapping(posix: PosixStore) -> None:
    cases: list[tuple[int, type[StoreError]]] = [
        (errno.ENOSPC, StoreFull),
        (errno.EDQUOT, StoreFull),
        (errno.ESTALE, StoreUnavailable),
        (errno.EIO, StoreUnavailable),
        (errno.ENOENT, StoreNotFound),
        (errno.EINVAL, StoreError),
    ]
    for code, kind in cases:
        with pytest.raises(kind), posix._translate("write"):
            raise OSError(code, os.strerror(code))


def test_open_store_factory(tmp_path: Path, s3_server: S3Server) -> None:  # noqa: F811
    assert isinstance(open_store(str(tmp_path)), PosixStore)
    assert isinstance(open_store(store_url=f"file://{tmp_path}"), PosixStore)
    s3 = open_store(store_url=f"s3://{s3_server.bucket}/a/b", part_size=None, **s3_server.store_kwargs())
    assert isinstance(s3, S3Store) and s3.prefix == "a/b"
    assert s3.describe() == f"s3://{s3_server.bucket}/a/b ({s3_server.endpoint_url})"
    bads: list[dict[str, Any]] = [{}, {"store_dir": "/x", "store_url": "s3://b"}, {"store_url": "gs://b"}]
    for bad in bads:
        with pytest.raises(ValueError):
            open_store(**bad)


# --- S3 ----------------------------------------------------------------------------------------------


@pytest.fixture
def s3(s3_server: S3Server) -> S3Store:  # noqa: F811
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    return S3Store(s3_server.bucket, prefix, part_size=5 * MiB, max_concurrency=4, **s3_server.store_kwargs())


def _uploads(s3: S3Store) -> list[str]:
    resp = s3.client.list_multipart_uploads(Bucket=s3.bucket, Prefix=s3.prefix + "/")
    return [u["Key"] for u in resp.get("Uploads", [])]


def test_s3_small_round_trip(s3: S3Store) -> None:
    data = b"hello checkpoint" * 1000
    with s3.open_writer("ck1/small.img") as w:
        w.write(data)
        obj = w.commit()
    assert obj.sha256 == hashlib.sha256(data).hexdigest()
    assert _read_all(s3, "ck1/small.img") == data
    assert s3.stat("ck1/small.img") == len(data)
    assert s3.exists("ck1/small.img") and not s3.exists("ck1/other")
    assert s3.list("ck1/") == ["ck1/small.img"] and s3.list("") == ["ck1/small.img"]
    head = s3.client.head_object(Bucket=s3.bucket, Key=f"{s3.prefix}/ck1/small.img", ChecksumMode="ENABLED")
    assert head["Metadata"]["sha256"] == obj.sha256
    assert head["ChecksumSHA256"] == base64.b64encode(hashlib.sha256(data).digest()).decode()
    s3.check()


def test_s3_multipart_round_trip(s3: S3Store) -> None:
    data = os.urandom(20 * MiB + 123)
    w = s3.open_writer("ck1/pages-1.img")
    for i in range(0, len(data), 3 * MiB):
        w.write(data[i : i + 3 * MiB])
    assert not s3.exists("ck1/pages-1.img") and s3.list("") == []  # parts are not objects
    assert _uploads(s3) == [f"{s3.prefix}/ck1/pages-1.img"]
    obj = w.commit()
    assert obj.size_bytes == len(data) and obj.sha256 == hashlib.sha256(data).hexdigest()
    assert _uploads(s3) == []
    assert _read_all(s3, "ck1/pages-1.img") == data
    head = s3.client.head_object(Bucket=s3.bucket, Key=f"{s3.prefix}/ck1/pages-1.img", ChecksumMode="ENABLED")
    parts = [hashlib.sha256(data[i : i + 5 * MiB]).digest() for i in range(0, len(data), 5 * MiB)]
    composite = base64.b64encode(hashlib.sha256(b"".join(parts)).digest()).decode()
    assert head["ChecksumSHA256"].split("-")[0] == composite  # moto leaves out the '-5' suffix
    assert head["ETag"].endswith('-5"')


def test_s3_verify_detects_mismatch(s3: S3Store) -> None:
    data = os.urandom(1000)
    _write(s3, "ck1/a.img", data)
    sha = hashlib.sha256(data).hexdigest()
    good = base64.b64encode(bytes.fromhex(sha)).decode()
    s3.verify("ck1/a.img", len(data), good, sha)
    with pytest.raises(StoreCorrupt, match="bytes"):
        s3.verify("ck1/a.img", len(data) + 1, good, sha)
    bad = base64.b64encode(hashlib.sha256(b"other").digest()).decode()
    with pytest.raises(StoreCorrupt, match="checksum"):
        s3.verify("ck1/a.img", len(data), bad, sha)
    with pytest.raises(StoreCorrupt, match="x-amz-meta-sha256"):
        s3.verify("ck1/a.img", len(data), good, "0" * 64)


def test_s3_not_found(s3: S3Store) -> None:
    with pytest.raises(StoreNotFound):
        s3.open_reader("ck1/missing")
    with pytest.raises(StoreNotFound):
        s3.stat("ck1/missing")
    assert s3.list("ck1/") == []


def test_s3_abort_and_cleanup(s3: S3Store) -> None:
    w = s3.open_writer("ck1/big.img")
    w.write(os.urandom(11 * MiB))
    w.abort()
    assert _uploads(s3) == [] and s3.list("") == []
    with s3.open_writer("ck1/small.img") as w2:
        w2.write(b"abc")
    assert s3.list("") == []
    crashed = s3.open_writer("ck1/crash.img")
    crashed.write(os.urandom(6 * MiB))
    assert len(_uploads(s3)) == 1
    assert s3.cleanup_temps() == 1 and _uploads(s3) == []


def test_s3_delete_prefix(s3: S3Store) -> None:
    for key in ("ck1/manifest.json", "ck1/a.img", "ck10/a.img"):
        _write(s3, key, b"data")
    s3.open_writer("ck1/b.img").write(os.urandom(6 * MiB))  # an interrupted upload
    s3.delete_prefix("ck1/")
    assert s3.list("") == ["ck10/a.img"] and _uploads(s3) == []


def test_s3_missing_bucket_unavailable(s3_server: S3Server) -> None:  # noqa: F811
    store = S3Store("no-such-bucket-x", max_attempts=1, **s3_server.store_kwargs())
    with pytest.raises(StoreUnavailable, match="create it"):
        store.check()
    with pytest.raises(StoreUnavailable):
        _write(store, "ck1/a.img", b"abc")


def test_s3_corrupt_object_detected_on_read(s3: S3Store) -> None:
    bad = base64.b64encode(hashlib.sha256(b"something else").digest()).decode()
    key = f"{s3.prefix}/ck1/bad.img"
    try:  # moto stores the client's checksum without checking it; real S3 would answer BadDigest
        s3.client.put_object(
            Bucket=s3.bucket, Key=key, Body=b"abc", ChecksumAlgorithm="SHA256", ChecksumSHA256=bad
        )
    except ClientError:
        pytest.skip("this S3 server validates checksums on upload")
    with pytest.raises(StoreCorrupt), s3.open_reader("ck1/bad.img") as r:
        r.read()


def test_s3_server_gone_mid_upload() -> None:
    with running_s3_server() as srv:
        store = S3Store(
            srv.bucket, part_size=5 * MiB, max_attempts=1, connect_timeout=0.5, **srv.store_kwargs()
        )
        w = store.open_writer("ck1/big.img")
        w.write(os.urandom(6 * MiB))
    with pytest.raises(StoreUnavailable):
        w.write(os.urandom(5 * MiB))
        w.commit()
    w.abort()  # already aborted: a no-op


def test_s3_unavailable_on_closed_port() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = S3Store(
        "bucket", "p", endpoint_url=f"http://127.0.0.1:{port}", region="us-east-1", access_key="a",
        secret_key="b", connect_timeout=0.5, read_timeout=0.5, max_attempts=1,
    )  # fmt: skip
    with pytest.raises(StoreUnavailable, match="cannot reach"):
        store.check()
    with pytest.raises(StoreUnavailable):
        _write(store, "ck1/a.img", b"abc")
    with pytest.raises(StoreUnavailable):
        w = store.open_writer("ck1/big.img")
        w.write(os.urandom(6 * MiB))
        w.commit()
    with pytest.raises(StoreUnavailable):
        store.open_reader("ck1/a.img")


# --- codec -------------------------------------------------------------------------------------------


def _sample(n: int) -> bytes:
    """Compressible but not trivial: random blocks between zero runs."""
    out = io.BytesIO()
    while out.tell() < n:
        out.write(os.urandom(4096) + bytes(12288))
    return out.getvalue()[:n]


@pytest.mark.parametrize("codec", [Codec(None), Codec(0), Codec(3), Codec(3, threads=2)])
def test_codec_round_trip(posix: PosixStore, codec: Codec) -> None:
    data = _sample(9 * MiB + 5)
    seen: list[int] = []
    with posix.open_writer("ck1/pages.img") as w:
        res = copy_encode(io.BytesIO(data), w, codec, progress=seen.append, chunk=1 * MiB)
        obj = w.commit()
    stored = (posix.root / "ck1/pages.img").read_bytes()
    assert sum(seen) == res.raw_bytes == len(data)
    assert res.stored_bytes == obj.size_bytes == len(stored) == posix.stat("ck1/pages.img")
    assert res.raw_blake3 == blake3.blake3(data).hexdigest()
    assert res.stored_blake3 == blake3.blake3(stored).hexdigest()
    if codec.compressed:
        assert res.stored_bytes < res.raw_bytes // 2 and codec.name == "zstd"
    else:
        assert stored == data and res.stored_blake3 == res.raw_blake3 and codec.name == "raw"
    out = io.BytesIO()
    with posix.open_reader("ck1/pages.img") as r:
        dec = copy_decode(r, out, codec.compressed, expected=res)
    assert out.getvalue() == data
    assert (dec.raw_bytes, dec.raw_blake3, dec.stored_bytes, dec.stored_blake3) == (
        res.raw_bytes, res.raw_blake3, res.stored_bytes, res.stored_blake3,
    )  # fmt: skip


def test_codec_detects_truncation(posix: PosixStore) -> None:
    data = _sample(2 * MiB)
    with posix.open_writer("ck1/a.img") as w:
        res = copy_encode(io.BytesIO(data), w, Codec(3))
        w.commit()
    stored = (posix.root / "ck1/a.img").read_bytes()
    with pytest.raises(StoreCorrupt):
        copy_decode(io.BytesIO(stored[:-100]), io.BytesIO(), True, expected=res)
    with pytest.raises(StoreCorrupt):
        copy_decode(io.BytesIO(stored[:100] + b"\xff" * 64 + stored[164:]), io.BytesIO(), True)


def test_codec_through_s3(s3: S3Store) -> None:
    data = _sample(7 * MiB)
    with s3.open_writer("ck1/pages.img") as w:
        res = copy_encode(io.BytesIO(data), w, Codec(1))
        w.commit()
    out = io.BytesIO()
    with s3.open_reader("ck1/pages.img") as r:
        copy_decode(r, out, True, expected=res)
    assert out.getvalue() == data
