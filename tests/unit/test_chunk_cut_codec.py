"""The vectorized chunk cut gives the cut points of its definition, and incompressible chunks are stored raw."""

from __future__ import annotations

import random

import pytest
import zstandard

from memsnap.store.chunks import (
    PAGE,
    ZSTD_MAGIC,
    Chunking,
    _cut_candidates,
    chunk_id,
    compressible,
    decode_chunk,
    encode_chunk,
)

_M64 = (1 << 64) - 1
_K = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)


def _definition(buf: bytes, first: int, last: int, avgp: int) -> list[int]:
    """The cut rule as docs/chunkstore.md defines it, one page at a time (the code before it was vectorized)."""
    out = []
    for i in range(first, last):
        w = [int.from_bytes(buf[i * PAGE + 8 * k: i * PAGE + 8 * k + 8], "little") for k in (0, 129, 258, 511)]
        h = ((w[0] * _K[0] ^ w[1] * _K[1] ^ w[2] * _K[2] ^ w[3] * _K[3]) + _K[0]) & _M64
        h ^= h >> 29
        h = (h * _K[1]) & _M64
        if (h >> 32) % avgp == 0:
            out.append(i)
    return out


def _mixed(n_pages: int, seed: int) -> bytes:
    """Random pages, zero pages, pages of one repeated word and text-like pages, interleaved."""
    r = random.Random(seed)
    parts = []
    for i in range(n_pages):
        k = i % 4
        parts.append(r.randbytes(PAGE) if k == 0 else bytes(PAGE) if k == 1 else
                     (r.getrandbits(64).to_bytes(8, "little") * (PAGE // 8)) if k == 2 else
                     bytes(r.choices(b"abc de", k=PAGE)))
    return b"".join(parts)


@pytest.mark.parametrize("avgp", [1, 3, 16, 256])
def test_the_vectorized_cut_finds_exactly_the_pages_of_its_definition(avgp: int) -> None:
    buf = _mixed(1500, avgp)
    assert _cut_candidates(buf, 0, 1500, avgp) == _definition(buf, 0, 1500, avgp)
    assert _cut_candidates(buf, 77, 1001, avgp) == _definition(buf, 77, 1001, avgp)


@pytest.mark.parametrize("window", [PAGE, 5 * PAGE + 100, 1 << 20, 16 << 20])
def test_a_file_read_a_window_at_a_time_is_cut_where_the_buffer_is(tmp_path, window: int) -> None:
    buf = _mixed(3000, 9) + b"tail"
    p = tmp_path / "pages-1.img"
    p.write_bytes(buf)
    with open(p, "rb") as f:
        assert list(Chunking(64 << 10).iter_file_boundaries(f.fileno(), len(buf), window)) == \
            Chunking(64 << 10).boundaries(buf)


def test_a_file_shorter_than_its_size_is_cut_without_error_as_if_zero_filled(tmp_path) -> None:
    buf = _mixed(300, 10)
    p = tmp_path / "pages-1.img"
    p.write_bytes(buf[: 100 * PAGE])
    with open(p, "rb") as f:
        got = list(Chunking(16 << 10).iter_file_boundaries(f.fileno(), len(buf), 64 * PAGE))
    assert got == Chunking(16 << 10).boundaries(buf[: 100 * PAGE] + bytes(200 * PAGE))


def test_a_random_chunk_is_stored_raw_and_reads_back() -> None:
    raw = random.Random(3).randbytes(1 << 20)
    assert not compressible(raw)
    stored = encode_chunk(raw, 3)
    assert stored == raw
    assert decode_chunk(stored, chunk_id(raw), len(raw)) == raw


def test_a_compressible_chunk_is_stored_as_a_zstd_frame_and_reads_back() -> None:
    raw = _mixed(256, 4)  # (a quarter of it random)
    assert compressible(raw)
    stored = encode_chunk(raw, 3)
    assert stored[:4] == ZSTD_MAGIC and len(stored) < len(raw) // 2
    assert decode_chunk(stored, chunk_id(raw), len(raw)) == raw


def test_a_random_chunk_that_starts_with_the_zstd_magic_is_still_framed() -> None:
    raw = ZSTD_MAGIC + random.Random(5).randbytes((1 << 20) - 4)
    stored = encode_chunk(raw, 3)
    assert zstandard.ZstdDecompressor().decompress(stored, max_output_size=len(raw)) == raw
    assert decode_chunk(stored, chunk_id(raw), len(raw)) == raw
