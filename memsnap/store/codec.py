"""Streaming zstd encode/decode into and out of a store, hashing (blake3) and counting in the same pass."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO, cast

import blake3
import zstandard

from memsnap.store.base import Bytes, MiB, StoreWriter
from memsnap.store.errors import StoreCorrupt
from memsnap.store.throttle import Throttle

CHUNK = 4 * MiB
Progress = Callable[[int], None]


@dataclass(frozen=True)
class Codec:
    """How image files are stored: level None/0 = raw, else zstd at that level with threads workers."""

    level: int | None = None
    threads: int = 0

    @property
    def compressed(self) -> bool:
        """Whether the stored bytes are a zstd frame."""
        return bool(self.level)

    @property
    def name(self) -> str:
        """'zstd' or 'raw' (for the manifest)."""
        return "zstd" if self.compressed else "raw"


@dataclass(frozen=True)
class EncodeResult:
    """Byte counts and hex blake3 of the raw input and of the stored (possibly compressed) output."""

    raw_bytes: int
    stored_bytes: int
    raw_blake3: str
    stored_blake3: str


@dataclass(frozen=True)
class DecodeResult:
    """Byte counts and hex blake3 of what was read back (stored) and produced (raw)."""

    raw_bytes: int
    raw_blake3: str
    stored_bytes: int
    stored_blake3: str


class EncodingWriter:
    """Compresses (or passes through) into a StoreWriter; finish() ends the frame but does not commit."""

    def __init__(self, dst: StoreWriter, codec: Codec, throttle: Throttle | None = None) -> None:
        self._dst, self._throttle = dst, throttle
        self._zstd = (
            zstandard.ZstdCompressor(
                level=codec.level or 0, threads=codec.threads, write_checksum=True
            ).compressobj()
            if codec.compressed
            else None
        )
        self._raw_hash = blake3.blake3()
        self._stored_hash = blake3.blake3() if codec.compressed else self._raw_hash
        self._raw_bytes = self._stored_bytes = 0

    def write(self, data: Bytes) -> int:
        """Encodes data and forwards the output to the store writer."""
        self._raw_hash.update(data)
        self._raw_bytes += len(data)
        self._emit(data if self._zstd is None else self._zstd.compress(data), hashed=self._zstd is None)
        return len(data)

    def _emit(self, out: Bytes, hashed: bool) -> None:
        if not out:
            return
        if not hashed:
            self._stored_hash.update(out)
        self._stored_bytes += len(out)
        if self._throttle is not None:
            self._throttle.consume(len(out))
        self._dst.write(out)

    def finish(self) -> EncodeResult:
        """Flushes the compressor and returns the counts and hashes."""
        if self._zstd is not None:
            self._emit(self._zstd.flush(), hashed=False)
            self._zstd = None
        return EncodeResult(
            self._raw_bytes, self._stored_bytes, self._raw_hash.hexdigest(), self._stored_hash.hexdigest()
        )


class _HashingSource:
    """Counts, hashes and throttles the stored bytes as they are pulled."""

    def __init__(self, src: BinaryIO, throttle: Throttle | None) -> None:
        self.src, self.throttle = src, throttle
        self.hash = blake3.blake3()
        self.nbytes = 0

    def read(self, n: int = -1) -> bytes:
        data = self.src.read(n)
        self.hash.update(data)
        self.nbytes += len(data)
        if self.throttle is not None:
            self.throttle.consume(len(data))
        return data


class DecodingReader:
    """A read()-able view of the raw bytes of a stored object; result() gives counts and hashes."""

    def __init__(
        self, src: BinaryIO, compressed: bool, throttle: Throttle | None = None, read_size: int = CHUNK
    ) -> None:
        self._source = _HashingSource(src, throttle)
        self._zstd = (
            zstandard.ZstdDecompressor().stream_reader(  # only read() is used on the source
                cast(BinaryIO, self._source), read_size=read_size, closefd=False
            )
            if compressed
            else None
        )
        self._raw_hash = blake3.blake3() if compressed else self._source.hash
        self._raw_bytes = 0

    def read(self, n: int = -1) -> bytes:
        """Up to n raw bytes (all that is left if n < 0); b'' at the end."""
        if n < 0:
            return b"".join(iter(lambda: self.read(CHUNK), b""))
        if self._zstd is None:
            data = self._source.read(n)
        else:
            try:
                data = self._zstd.read(n)
            except zstandard.ZstdError as e:
                raise StoreCorrupt(f"stored zstd stream is corrupt: {e}") from e
            self._raw_hash.update(data)
        self._raw_bytes += len(data)
        return data

    def result(self) -> DecodeResult:
        """Counts and hashes of everything read so far."""
        return DecodeResult(
            self._raw_bytes, self._raw_hash.hexdigest(), self._source.nbytes, self._source.hash.hexdigest()
        )

    def close(self) -> None:
        """Closes the underlying store reader."""
        self._source.src.close()


def copy_encode(
    src: BinaryIO,
    dst: StoreWriter,
    codec: Codec,
    throttle: Throttle | None = None,
    progress: Progress | None = None,
    chunk: int = CHUNK,
) -> EncodeResult:
    """Streams src into dst through codec; progress gets each chunk's raw byte count. Caller commits dst."""
    enc = EncodingWriter(dst, codec, throttle)
    while data := src.read(chunk):
        enc.write(data)
        if progress is not None:
            progress(len(data))
    return enc.finish()


def copy_decode(
    src: BinaryIO,
    dst: BinaryIO,
    compressed: bool,
    throttle: Throttle | None = None,
    progress: Progress | None = None,
    chunk: int = CHUNK,
    expected: EncodeResult | None = None,
) -> DecodeResult:
    """Streams a stored object into dst; with expected, raises StoreCorrupt on any count/hash mismatch."""
    dec = DecodingReader(src, compressed, throttle, chunk)
    while data := dec.read(chunk):
        dst.write(data)
        if progress is not None:
            progress(len(data))
    res = dec.result()
    if expected is not None:
        got = (res.raw_bytes, res.raw_blake3, res.stored_bytes, res.stored_blake3)
        want = (expected.raw_bytes, expected.raw_blake3, expected.stored_bytes, expected.stored_blake3)
        if got != want:
            raise StoreCorrupt(f"read back (raw, blake3, stored, blake3) = {got}, expected {want}")
    return res
