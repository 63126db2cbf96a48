"""`restore --lazy` of a checkpoint whose tier copy is gone: the job runs while its pages are in the store.

    store                      memsnapd                                   restore work dir
    signed manifest  --------> verified (signature, binding)
    small files      --------> fetched whole, each hash checked --------> images/ (all but the pages)
    pagemaps                   -> PageIndex: lazy and eager ranges
    eager pages      --------> read through the PageSource     --------> images/pages-N.img (sparse: only
                                                                          what `criu restore` reads itself)
    lazy pages       <-------> PageServer <-- socketpair --> `criu lazy-pages --page-server --ps-socket`
                               (faults first, prefetch in order)          `criu restore --lazy-pages`: runs

When a page cannot be had (the store fails, a chunk does not verify), no fault is answered any more: the
tasks are killed first (while CRIU restores: every task it forked, and its restore fails), then lazy-pages
(memsnap.lazyguard), so none ever reads a page that is not its own (once userfaultfd is gone, its missing pages
would read as zeros). The reason lands in the checkpoint's last_error (`show`), the daemon log and
memsnap_restores_total{result="store_failed"}.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import blake3

from memsnap import failpoints, knobs, proc, safefs
from memsnap.catalog import CheckpointRecord
from memsnap.errors import IntegrityFailure, Unavailable
from memsnap.lazyguard import LazyGuard
from memsnap.manifest import Manifest, StoredManifest
from memsnap.pageserver.images import ImageError, PageIndex
from memsnap.pageserver.server import PageServer, read_retrying
from memsnap.pageserver.sources import ChunkSource, PageSource, SourceFailed
from memsnap.pageserver.wire import iov_layout
from memsnap.repository import Repository
from memsnap.restorer import PreparedImage
from memsnap.store.chunks import ChunkedStorage

if TYPE_CHECKING:
    from memsnap.restorer import RestoreHost, Restorer, RestoreRequest, RestoreResult

log = logging.getLogger("memsnap.pageserver")

_PAGES_NAME = re.compile(r"^pages-\d+\.img$")
_GRACE_S = 10.0  # how long a failed page server waits for lazy-pages to give up before killing it


class CutAfterResume:
    """Failpoints (tests): lazy-store-cut, a source whose store stops answering once the restored job asked
    for its first lazy page (while CRIU restores); lazy-store-cut-late, once 8 MiB more were read after that
    (the job runs); slow-lazy-store, one whose reads take 0.2 s each once it asked."""

    LATE = 8 << 20

    def __init__(self, inner: PageSource, cut: bool, late: bool = False) -> None:
        self.inner = inner
        self.cut, self.late = cut or late, late
        self.resumed = threading.Event()
        self._read = 0

    def _check(self) -> None:
        if self.resumed.is_set() and self.cut and (not self.late or self._read >= self.LATE):
            raise SourceFailed("failpoint lazy-store-cut: the store stopped answering")

    def read_at(self, name: str, offset: int, length: int) -> bytes:
        self._check()
        if self.resumed.is_set() and not self.cut:
            time.sleep(0.2)
        data = self.inner.read_at(name, offset, length)
        if self.resumed.is_set():
            self._read += len(data)
        return data

    def blocks(self, name: str) -> list[tuple[int, int]]:
        return self.inner.blocks(name)

    def finish(self) -> None:
        self._check()
        self.inner.finish()

    def close(self) -> None:
        self.inner.close()


class Prepared:
    """A restore dir with everything but the lazy pages, and where those come from."""

    def __init__(self, root: Path, man: Manifest, index: PageIndex, source: PageSource,
                 fetch_ms: float) -> None:
        self.root, self.images, self.man, self.index, self.source = root, root / "images", man, index, source
        self.fetch_ms = fetch_ms


def prepare(repo: Repository, rec: CheckpointRecord, stored: StoredManifest, storage: ChunkedStorage,
            root: Path) -> Prepared:
    """Fetches and verifies the small files of a chunked stored checkpoint (stored, its storage) into
    root/images, and writes the eager pages there."""
    t0 = time.monotonic()
    images = root / "images"
    images.mkdir(parents=True, mode=0o700)
    files = storage.files
    source: PageSource = ChunkSource(repo.chunk_reader(storage), lambda: repo.storage_error("get"))

    def fetch(name: str, dfd: int) -> None:
        try:
            data = source.read_at(name, 0, files[name].size)
        except SourceFailed as exc:
            raise (IntegrityFailure if exc.integrity else Unavailable)(
                f"cannot restore {rec.id} from the store: {exc}") from exc
        if blake3.blake3(data).hexdigest() != files[name].blake3:
            raise IntegrityFailure(f"integrity check failed: checksum mismatch in stored {name} of {rec.id}")
        with os.fdopen(safefs.create_file(dfd, name, 0o600), "wb") as out:
            out.write(data)

    with safefs.opened(os.open(images, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)) as dfd:
        for name in sorted(n for n in files if not _PAGES_NAME.match(n)):
            fetch(name, dfd)
        try:
            index = PageIndex.from_images({n: (images / n).read_bytes() for n in files if n.startswith("pagemap-")})
        except ImageError as exc:
            raise IntegrityFailure(f"checkpoint {rec.id}: a pagemap image does not parse: {exc}") from exc
        lazy_files = index.pages_files() & set(files)
        for name in sorted(n for n in files if _PAGES_NAME.match(n) and n not in lazy_files):
            fetch(name, dfd)  # (shared memory: CRIU restores it itself)
        if any(map(failpoints.armed, ("lazy-store-cut", "lazy-store-cut-late", "slow-lazy-store"))):
            source = CutAfterResume(source, cut=failpoints.armed("lazy-store-cut"),
                                    late=failpoints.armed("lazy-store-cut-late"))
        fds: dict[str, int] = {}
        try:
            for name in sorted(lazy_files):
                fds[name] = safefs.create_file(dfd, name, 0o600)
                os.ftruncate(fds[name], files[name].size)  # sparse: the lazy pages never land here

            def eager(r: tuple[str, int, int]) -> None:
                os.pwrite(fds[r[0]], read_retrying(source, *r), r[1])

            # In parallel: the job waits for these (a few MiB of libraries' data and stacks, in several chunks).
            with ThreadPoolExecutor(max_workers=8, thread_name_prefix="lazystore-eager") as pool:
                list(pool.map(eager, index.ranges(lazy=False)))
        except SourceFailed as exc:
            source.close()
            cls = IntegrityFailure if exc.integrity else Unavailable
            raise cls(f"cannot restore {rec.id} from the store: {exc}") from exc
        except BaseException:
            source.close()
            raise
        finally:
            for fd in fds.values():
                os.close(fd)
    return Prepared(root, stored.man, index, source, (time.monotonic() - t0) * 1000)


def restore_from_store(restorer: Restorer, rec: CheckpointRecord, t0: float,
                       req: RestoreRequest) -> RestoreResult | None:
    """Restorer.restore(lazy=True) of a checkpoint with no tier copy but a durable stored one: the job resumes
    at once, its pages follow from the store. Returns None when the tier copy is there after all (the
    caller restores from it)."""
    engine = restorer.host
    repo = engine.repo
    assert repo is not None  # (Restorer.pages_from_store)
    root = engine.work_root / f"{rec.id}.lazystore-{secrets.token_hex(3)}"
    with engine.checkpoint_lock(rec.id):
        cur = engine.catalog.get_checkpoint(rec.id)
        if cur is None or (cur.in_tier and engine.tier.has(rec.id)) or not cur.in_store:
            return None
        try:
            stored = repo.stored_manifest(rec)
            if stored.chunked is None:
                # A whole-file (format 1) copy can be verified only whole: served before its hash is known,
                # a forged one would run until the end. It is fetched and verified first, as before.
                return None
            t_man = time.monotonic()
            iov = iov_layout(engine.criu.version())  # (lazy-pages' CRIU: the page-server header it speaks)
            prep = prepare(repo, rec, stored, stored.chunked, root)
        except (IntegrityFailure, Unavailable) as exc:  # (the store failed, or a file or chunk did not verify)
            shutil.rmtree(root, ignore_errors=True)
            _refused(engine, rec, str(exc), t0)
            raise
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            engine.observe("restore", "error", time.monotonic() - t0)
            raise
        restorer.mark_reading(rec.id, +1)  # (delete waits: from lazy-pages' start on, lazy_in_use says so)
    log.info("lazy restore of %s from the store: manifest %.0f ms, small files and eager pages %.0f ms",
             rec.id, (t_man - t0) * 1000, prep.fetch_ms, extra={"checkpoint_id": rec.id})
    guard = LazyGuard(rec.id)
    watch = _Watch(engine, rec, prep, guard, restorer.reap_lazy)
    ours, theirs = socket.socketpair()
    server = PageServer(ours, prep.index, prep.source, iov=iov, on_fail=watch.failed, name=rec.id,
                        on_first_request=prep.source.resumed.set if isinstance(prep.source, CutAfterResume)
                        else None, held=True)
    watch.server = server
    server.start()
    t1 = time.monotonic()
    try:
        res = restorer.restore_image(rec, PreparedImage(prep.man, prep.images, t0, t1, prep.fetch_ms, True),
                                     replace(req, lazy=True, lazy_ps_socket=theirs.fileno(), lazy_guard=guard))
    except BaseException as exc:
        why = server.error
        server.fail("the restore failed")
        watch.cleanup()
        if why:  # (the pages could not be had: that, not how CRIU noticed it, is the reason)
            _refused(engine, rec, why, t0, "; the tasks CRIU was restoring were killed before they ran")
            raise _store_error(why)(f"restore of {rec.id} failed: {why}; nothing was left running") from exc
        raise
    finally:
        theirs.close()  # lazy-pages holds its own copy
        restorer.mark_reading(rec.id, -1)
    res.verify_ms = 0.0  # (every file and chunk is verified as it arrives)
    try:
        watch.started(res)
    finally:
        server.release()
    return res


def _refused(engine: RestoreHost, rec: CheckpointRecord, why: str, t0: float, then: str = "") -> None:
    msg = f"lazy restore from the store refused before the job resumed: {why}{then}"
    engine.catalog.update_checkpoint(rec.id, last_error=msg)
    engine.observe("restore", "store_failed", time.monotonic() - t0)
    log.error(msg, extra={"checkpoint_id": rec.id})


_ACTIVE: set[_Watch] = set()
_ACTIVE_LOCK = threading.Lock()


def paging_in() -> int:
    """How many lazy restores from the store still page in (their jobs die with this daemon)."""
    with _ACTIVE_LOCK:
        return len(_ACTIVE)


def wait_paged_in(timeout: float) -> int:
    """Waits up to timeout s for the lazy restores from the store to finish paging in (a graceful stop
    should: a job still paging in dies with the daemon); returns how many are still going."""
    deadline = time.monotonic() + timeout
    while paging_in() and time.monotonic() < deadline:
        time.sleep(0.1)
    return paging_in()


def _store_error(why: str) -> type[IntegrityFailure] | type[Unavailable]:
    return IntegrityFailure if "integrity" in why or "checksum" in why else Unavailable


class _Watch:
    """Follows one lazy restore from the store to its end: records a failure, kills the job, cleans up."""

    def __init__(self, engine: RestoreHost, rec: CheckpointRecord, prep: Prepared, guard: LazyGuard,
                 reap_lazy: Callable[[], None]) -> None:
        self.engine, self.rec, self.prep, self.guard = engine, rec, prep, guard
        self.reap_lazy = reap_lazy
        self.server: PageServer | None = None
        self.pid = 0
        self.job_id = ""
        self.t_resumed = 0.0
        self.work_dir: Path | None = None
        self._lock = threading.Lock()

    def failed(self, why: str) -> None:
        """The page server gave up: the tasks die (restored, or still restoring), then lazy-pages. A job that ran
        gets its reason recorded first: whoever sees it gone (`memsnapctl show`) reads why."""
        why = f"paging in from the store failed: {why}"
        with self._lock:
            ran = bool(self.pid)
        if ran:
            self.engine.catalog.update_checkpoint(self.rec.id, last_error=self._message(why))
        self.guard.fail(why)

    def started(self, res: Any) -> None:
        with self._lock:
            self.pid, self.job_id = res.pid, res.job.id
        self.work_dir = res.work_dir
        self.t_resumed = time.monotonic()
        server = self.server
        assert server is not None
        if server.error:  # (failed as CRIU returned: the job was killed before it ran on a missing page)
            why = server.error
            self._record(f"paging in from the store failed: {why}")
            self.cleanup()
            raise _store_error(why)(f"restore of {self.rec.id} from the store failed: {why}; the restored "
                                    "copy was killed")
        with _ACTIVE_LOCK:
            _ACTIVE.add(self)
        threading.Thread(target=self._follow, args=(res.lazy_server,), name=f"lazystore-{self.rec.id}",
                         daemon=True).start()

    def _follow(self, lazy_pages: Any) -> None:
        try:
            self._verdict(lazy_pages)
        except Exception:
            log.exception("lazy restore of %s from the store: following it failed", self.rec.id)
        finally:
            self.cleanup()
            with _ACTIVE_LOCK:
                _ACTIVE.discard(self)

    def _verdict(self, lazy_pages: Any) -> None:
        server = self.server
        assert server is not None
        while True:
            try:
                rc = lazy_pages.wait(timeout=1.0)
                break
            except Exception:  # subprocess.TimeoutExpired
                if server.t_failed and time.monotonic() - server.t_failed > _GRACE_S:
                    try:  # (its supervisor shell leads the group; the job is killed by us)
                        os.killpg(lazy_pages.pid, signal.SIGKILL)
                    except OSError:
                        pass
        server.done.wait(5.0)
        if rc != 0 or server.error or not server.ok.is_set():
            why = server.error or f"lazy-pages exited {rc} before every page arrived (see " \
                                  f"{self.work_dir}/lazy-pages.log)"
            self._record(f"paging in from the store failed: {why}")
        else:
            secs = (server.t_closed or time.monotonic()) - self.t_resumed
            st = server.stats()
            mib = st["lazy_bytes"] / (1 << 20)
            log.info("lazy restore of %s from the store: every page resident %.2f s after the job resumed "
                     "(%.0f MiB, %.0f MiB/s; %d requests; chunks read from memory %d times, waited for %d times, "
                     "fetched at once %d times; %d faults waited on the store, %.0f ms in all; %d faults answered "
                     "in p50 %.1f ms, p99 %.1f ms, max %.0f ms; %d background requests answered short; prefetch done "
                     "%.2f s after the server started)", self.rec.id, secs, mib,
                     mib / secs if secs > 0 else 0.0, st["requests"], st["cache_hits"] - st["cache_waits"],
                     st["cache_waits"], st["cache_misses"], st["fault_waits"], st["fault_wait_s"] * 1000,
                     st["faults"], st["fault_p50_ms"], st["fault_p99_ms"], st["fault_max_ms"], st["short_replies"],
                     st["prefetch_done_s"],
                     extra={"checkpoint_id": self.rec.id, "job": self.job_id})
            self.engine.observe("phase:page_in", "ok", secs)

    def _message(self, why: str) -> str:
        return f"lazy restore into job {self.job_id} (pid {self.pid}) killed: {why}"

    def _record(self, why: str) -> None:
        msg = self._message(why)
        if self.pid:
            proc.kill_tree(self.pid)
        if self.job_id:
            self.engine.catalog.update_job(self.job_id, ended=True)
        self.engine.catalog.update_checkpoint(self.rec.id, last_error=msg)
        log.error(msg, extra={"checkpoint_id": self.rec.id, "job": self.job_id})
        self.engine.observe("restore", "store_failed", time.monotonic() - (self.t_resumed or time.monotonic()))

    def cleanup(self) -> None:
        if self.server is not None:
            self.server.close()
        self.prep.source.close()
        if not knobs.keep_logs():
            shutil.rmtree(self.prep.root, ignore_errors=True)
        self.reap_lazy()

