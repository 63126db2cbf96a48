"""What a node knows of one chunk store's contents, and the mark and sweep that frees unreferenced chunks.

See docs/chunkstore.md ("Garbage collection").
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from memsnap import failpoints
from memsnap.store.chunks import CHUNK_PREFIX, ChunkStore, chunk_key, is_chunk_id


class ChunkIndex:
    """Ids of the chunks this node knows to be in one store (a hint that spares an existence check before
    an upload; every drain still checks each reused chunk is in the store, see memsnap.store.chunked)."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = Path(path) if path else None
        self._ids: set[str] = set()
        self._lock = threading.Lock()
        if self.path is not None and self.path.is_file():
            for line in self.path.read_text().split():
                if is_chunk_id(line):
                    self._ids.add(line)

    def __contains__(self, cid: object) -> bool:
        with self._lock:
            return cid in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, cids: list[str]) -> None:
        """Records ids as present (appended to the index file)."""
        with self._lock:
            new = [c for c in cids if c not in self._ids]
            self._ids.update(new)
            if new and self.path is not None:
                self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                with os.fdopen(fd, "a") as f:
                    f.write("".join(c + "\n" for c in new))

    def discard(self, cids: list[str] | set[str]) -> None:
        """Forgets ids (missing from the store, or swept); rewrites the index file."""
        with self._lock:
            if not self._ids & set(cids):
                return
            self._ids -= set(cids)
            if self.path is not None:
                tmp = self.path.with_name(f".tmp-{self.path.name}")
                tmp.write_text("".join(c + "\n" for c in sorted(self._ids)))
                os.chmod(tmp, 0o600)
                os.replace(tmp, self.path)



# -- mark and sweep ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SweepResult:
    """What a sweep deleted (or would delete, dry run), the bytes freed, and the unreferenced chunks it kept
    because they are younger than the grace period (a drain running now may reference them next)."""

    deleted: int
    bytes_freed: int
    kept_in_grace: int


def sweep(store: ChunkStore, keep: set[str], grace_s: float, dry_run: bool = False,
          now: float | None = None) -> SweepResult:
    """Deletes every chunk object not in keep whose last upload or reuse (mtime) is older than grace_s.

    keep must be the union of referenced_chunks() over every stored manifest, listed BEFORE this call: a
    drain that reuses a chunk refreshes its mtime first (touch), and a new chunk is young, so neither is
    deleted while its manifest is being written. On POSIX the mtime is checked again right before each
    unlink. Crash-safe at any point: a chunk is either kept or gone, and only unreferenced ones go.
    """
    now = time.time() if now is None else now
    cutoff = now - grace_s
    deleted = freed = in_grace = 0
    for key, size, mtime in store.list_with_mtime(CHUNK_PREFIX):
        cid = key.rsplit("/", 1)[-1]
        if not is_chunk_id(cid) or key != chunk_key(cid) or cid in keep:
            continue
        if mtime > cutoff:
            in_grace += 1
            continue
        if dry_run:
            deleted, freed = deleted + 1, freed + size
            continue
        if store.delete_keys([key], not_after=cutoff):
            deleted, freed = deleted + 1, freed + size
            failpoints.hit("sweep-deleted-one")
    return SweepResult(deleted, freed, in_grace)


