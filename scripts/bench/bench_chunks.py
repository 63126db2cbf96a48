#!/usr/bin/env python3
"""Chunk store benchmark: periodic checkpoints drained whole vs chunked, side by side, from the same tier copies.

A real memsnapd (its own drain throttled to a trickle, so that it stays out of the way) dumps each workload
N times, every --interval seconds, into its memory tier. Each tier copy is then drained by the daemon's own
drain code (memsnap.drain.DrainService._drain, in this process) twice: once in today's whole-image format
into one POSIX store, once chunked into another (which keeps the chunks of the earlier checkpoints: dedup).
Reported per checkpoint: stored bytes, seconds to durable, store operations. Then: a second job with the same
weights; restore from the store (whole vs chunked cold vs warm chunk cache vs chunks of other tier copies);
the dedup ratio against the average chunk size over the same tier copies; drain throughput against a plain
write of the same bytes through the same mount.

    PYTHONPATH=. python3 scripts/bench/bench_chunks.py [--weights-mib 1024] [--interval 10] [--count 5]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from memsnap import manifest  # noqa: E402
from memsnap.catalog import Catalog, CheckpointRecord  # noqa: E402
from memsnap.drain import DrainService  # noqa: E402
from memsnap.repository import Repository  # noqa: E402
from memsnap.store import Codec, PosixStore, Throttle  # noqa: E402
from memsnap.store import chunked as chunked_mod  # noqa: E402
from memsnap.store import chunks as chunks_mod  # noqa: E402
from memsnap.store.chunked import ChunkOpts  # noqa: E402
from memsnap.store.chunks import Chunking, chunk_id, is_bundled  # noqa: E402
from memsnap.tier import MemoryTier  # noqa: E402
from tests.helpers import DaemonProc  # noqa: E402

MiB = 1 << 20
OPS = ("open_writer", "open_reader", "exists", "stat", "touch", "list", "list_with_mtime", "delete_keys", "read_range",
       "read_tail", "open_ranges")
FORMATS = ("whole", "chunked", "loose")  # loose: chunked with an object per chunk (store.pack_size = ""), 6b0accd's


class Counting:
    """A store proxy that counts the store operations (object puts and gets, stats, touches, lists)."""

    def __init__(self, inner: Any) -> None:
        self._inner, self.ops = inner, 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name in OPS:
            def counted(*a: Any, **kw: Any) -> Any:
                self.ops += 1
                return attr(*a, **kw)
            return counted
        return attr


class _LinkWriter:
    def __init__(self, w: Any, t: Throttle) -> None:
        self._w, self._t, self.key = w, t, w.key

    def write(self, data: Any) -> int:
        self._t.consume(len(data))
        return int(self._w.write(data))

    def commit(self) -> Any:
        return self._w.commit()

    def abort(self) -> None:
        self._w.abort()

    def __enter__(self) -> _LinkWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self._w.abort()


class _LinkReader:
    def __init__(self, r: Any, t: Throttle) -> None:
        self._r, self._t = r, t

    def read(self, n: int = -1) -> bytes:
        data: bytes = self._r.read(n)
        self._t.consume(len(data))
        return data

    def close(self) -> None:
        self._r.close()

    def __enter__(self) -> _LinkReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._r.close()


class _LinkRanges:
    def __init__(self, r: Any, t: Throttle) -> None:
        self._r, self._t = r, t

    def read(self, offset: int, length: int) -> bytes:
        data: bytes = self._r.read(offset, length)
        self._t.consume(len(data))
        return data

    def close(self) -> None:
        self._r.close()


class Linked:
    """A store proxy whose object bytes cross a link of `rate` bytes/s each way (memsnap's token bucket): a
    stand-in for a network store where none can be set up (no sshd for scripts/bench/netstore.py)."""

    def __init__(self, inner: Any, up: Throttle, down: Throttle) -> None:
        self._inner, self._up, self._down = inner, up, down

    def open_writer(self, key: str) -> _LinkWriter:
        return _LinkWriter(self._inner.open_writer(key), self._up)

    def open_reader(self, key: str) -> _LinkReader:
        return _LinkReader(self._inner.open_reader(key), self._down)

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        # (a chunk in a pack: before this, ranged reads crossed no link, so packed fetches here were unthrottled)
        data: bytes = self._inner.read_range(key, offset, length)
        self._down.consume(len(data))
        return data

    def open_ranges(self, key: str) -> _LinkRanges:
        return _LinkRanges(self._inner.open_ranges(key), self._down)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _OldFetchPath:
    """--compare REV: while entered, the daemon code's chunked fetch (fetch_chunked, the chunk cache it opens, the
    ChunkReader it builds) is REV's, loaded from git (memsnap/store/chunks.py and chunked.py at REV)."""

    def __init__(self, rev: str) -> None:
        def load(path: str, name: str, subst: tuple[str, str] = ("", "")) -> types.ModuleType:
            src = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{path}"], check=True, capture_output=True,
                                 text=True).stdout.replace(*subst)
            mod = types.ModuleType(name)
            mod.__file__ = f"{rev}:{path}"
            sys.modules[name] = mod
            exec(compile(src, mod.__file__, "exec"), mod.__dict__)
            return mod
        self.chunks = load("memsnap/store/chunks.py", "_old_chunks")
        self.chunked = load("memsnap/store/chunked.py", "_old_chunked",
                            ("memsnap.store.chunks import", "_old_chunks import"))
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> _OldFetchPath:
        for mod, attr, val in ((chunked_mod, "fetch_chunked", self.chunked.fetch_chunked),
                               (chunked_mod, "open_cache", self.chunked.open_cache),
                               (chunks_mod, "ChunkReader", self.chunks.ChunkReader)):
            self._saved.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, val)
        return self

    def __exit__(self, *exc: object) -> None:
        while self._saved:
            setattr(*self._saved.pop())


def workloads(weights_mib: int) -> dict[str, list[str]]:
    py = sys.executable
    return {
        "train": [py, str(REPO / "scripts/bench/workload_train.py"), "--sleep", "0.01"],
        "infer": [py, str(REPO / "tests/workloads/infer.py"), "--weights-mib", str(weights_mib), "--state-mib", "16",
                  "--seed", "bench-weights", "--interval", "0.1", "--digest-every", "100000"],
        "counter": [py, str(REPO / "tests/workloads/counter.py"), "--mib", "256", "--interval", "0.1"],
    }


class Bench:
    def __init__(self, base: Path, args: argparse.Namespace, stores: Path | None = None) -> None:
        self.base, self.args = base, args
        self.stores = stores or base  # (--netstore: the sshfs mount)
        mount = []
        if args.tier_mount:  # the shipped configuration: memsnapd mounts its tier (a tmpfs, huge=within_size)
            (base / "tier-mount.toml").write_text('[tier]\nmount = true\nhuge_pages = "within_size"\n')
            mount = ["--config", str(base / "tier-mount.toml")]
        self.d = DaemonProc(base / "daemon", extra=["--drain-bandwidth", "1K", "--store-format", "whole", *mount])
        self.key = b""
        self.cat = Catalog(base / "bench-state")
        self.codec = Codec(level=3, threads=-1)
        self.link = (Throttle(args.link_mbit * 125_000), Throttle(args.link_mbit * 125_000)) if args.link_mbit \
            else None
        self.whole_store = self.linked(PosixStore(self.stores / "store-whole", create=True))
        self.chunk_store = self.linked(PosixStore(self.stores / "store-chunked", create=True))
        self.loose_store = self.linked(PosixStore(self.stores / "store-loose", create=True))

    def linked(self, store: PosixStore) -> Any:
        return Linked(store, *self.link) if self.link else store

    def start(self) -> None:
        self.d.start()
        self.key = (self.d.state / "hmac.key").read_bytes()
        self.tier = MemoryTier(self.d.tier)

    def service(self, fmt: str, store: Any, state: str = "", cache: int = 0) -> DrainService:
        """A drain service; fmt "loose" = chunked, an object per chunk (no packs)."""
        packs = {"pack_size": 0} if fmt == "loose" else {}
        opts = ChunkOpts(format="chunked" if fmt == "loose" else fmt, avg=self.args.chunk_size, state_dir=state,
                         cache_dir=f"{state}/cache", cache_size=cache, threads=self.args.threads, **packs)
        return DrainService(Repository(store, self.key, self.codec, chunk_opts=opts), self.cat, self.tier)

    def checkpoint(self, job_id: str) -> CheckpointRecord:
        r = json.loads(self.d.ctl("--json", "checkpoint", job_id, check=True).stdout)
        theirs = Catalog(self.d.state).get_checkpoint(r["id"])
        assert theirs is not None
        if self.cat.get_checkpoint(theirs.id) is None:
            self.cat.add_checkpoint(theirs)
        return theirs

    def drain(self, fmt: str, rec: CheckpointRecord) -> dict[str, Any]:
        store = Counting({"whole": self.whole_store, "chunked": self.chunk_store, "loose": self.loose_store}[fmt])
        state = {"chunked": str(self.base / "bench-state"), "loose": str(self.base / "bench-state-loose")}
        svc = self.service(fmt, store, state.get(fmt, ""))
        t0 = time.monotonic()
        stored = svc._drain(rec)
        secs = time.monotonic() - t0
        meta = (self.cat.get_checkpoint(rec.id) or rec).meta.get("store", {}) if fmt != "whole" else {}
        return {"stored_bytes": stored, "seconds": round(secs, 3), "store_ops": store.ops,
                "new_bytes": meta.get("new_bytes", rec.size_bytes) if fmt != "whole" else rec.size_bytes,
                "chunks": meta.get("chunks", 0), "new_chunks": meta.get("new_chunks", 0)}

    def periodic(self, name: str, argv: list[str]) -> dict[str, Any]:
        with self.d.client() as c:
            job = c.run(argv)
        time.sleep(self.args.warmup)
        rows, recs = [], []
        for i in range(self.args.count):
            if i:
                time.sleep(self.args.interval)
            rec = self.checkpoint(job.id)
            recs.append(rec)
            row: dict[str, Any] = {"n": i + 1, "id": rec.id, "logical_bytes": rec.size_bytes}
            for fmt in FORMATS[i % 3:] + FORMATS[:i % 3]:  # (each goes first in turn)
                row[fmt] = self.drain(fmt, rec)
            rows.append(row)
            print(f"{name} #{i + 1}: {rec.size_bytes / MiB:.0f} MiB; whole {row['whole']}; chunked {row['chunked']}; "
                  f"loose {row['loose']}", flush=True)
            if i < self.args.count - 1:  # whole copies have no dedup: keep only the last one (disk space)
                self.whole_store.delete_prefix(rec.id + "/")
        out: dict[str, Any] = {"job": job.id, "checkpoints": rows}
        later = rows[1:]
        if later:
            out["stored_ratio_from_2nd"] = round(statistics.median(r["whole"]["stored_bytes"] for r in later) /
                                                 statistics.median(r["chunked"]["stored_bytes"] for r in later), 2)
            out["seconds_ratio_from_2nd"] = round(statistics.median(r["whole"]["seconds"] for r in later) /
                                                  statistics.median(r["chunked"]["seconds"] for r in later), 2)
            for fmt in FORMATS:
                out[f"{fmt}_ops_median_from_2nd"] = statistics.median(r[fmt]["store_ops"] for r in later)
                out[f"{fmt}_seconds_median_from_2nd"] = statistics.median(r[fmt]["seconds"] for r in later)
        if not self.args.no_sweep:
            out["dedup_by_chunk_size"] = self.sweep_sizes(recs)
        out["restore"] = self.restore(recs)
        out["_recs"] = recs
        return out

    def sweep_sizes(self, recs: list[CheckpointRecord]) -> dict[str, Any]:
        """Raw new bytes per checkpoint (2nd on) and chunking speed, for several average chunk sizes."""
        res: dict[str, Any] = {}
        for avg in (64 << 10, 256 << 10, 1 << 20, 4 << 20):
            seen: set[str] = set()
            news, secs, logical, nchunks = [], 0.0, 0, 0
            for rec in recs:
                new = 0
                for p in sorted(self.tier.path(rec.id).iterdir()):
                    if p.name == manifest.MANIFEST or is_bundled(p.name, p.stat().st_size):
                        continue
                    data = p.read_bytes()
                    t0 = time.monotonic()
                    bounds = Chunking(avg).boundaries(data)
                    secs += time.monotonic() - t0
                    logical += len(data)
                    nchunks += len(bounds)
                    for off, n in bounds:
                        cid = chunk_id(memoryview(data)[off:off + n])
                        if cid not in seen:
                            seen.add(cid)
                            new += n
                news.append(new)
            res[f"{avg >> 10}K"] = {"new_bytes": news, "median_new_from_2nd": statistics.median(news[1:]) if
                                    len(news) > 1 else news[0], "chunks_per_checkpoint": nchunks // len(recs),
                                    "chunking_MBps": round(logical / MiB / max(secs, 1e-9))}
        return res

    def restore(self, recs: list[CheckpointRecord]) -> dict[str, Any]:
        """Fetch of the last checkpoint, --repeat times (medians): whole; chunked with no local chunks (cold: an
        empty cache, filled by that fetch); with that warm cache; with the other checkpoints' tier copies. With
        --compare REV, also REV's chunked fetch path (fetch_chunked, ChunkCache, ChunkReader) cold and warm, each
        with its own cache, in the same rounds (alternating order)."""
        rec = recs[-1]
        runs: dict[str, list[float]] = {}
        paths = {"new": None, "old": _OldFetchPath(self.args.compare) if self.args.compare else None}

        def fetch(label: str, svc: DrainService) -> None:
            dest = Path(self.args.fetch_dir or self.tier.root) / f".bench-fetch-{label}"
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir(mode=0o700)
            os.sync()  # (the writeback of the previous fetch's files and cache entries is not this one's cost)
            t0 = time.monotonic()
            svc.repo.fetch(rec, dest)
            runs.setdefault(label, []).append(round(time.monotonic() - t0, 3))
            for name, meta in manifest.read(dest)["files"].items():
                assert (dest / name).stat().st_size == meta["size"]
            shutil.rmtree(dest, ignore_errors=True)

        for i in range(self.args.repeat):
            fetch("whole", self.service("whole", self.whole_store))
            for which in (("new", "old") if i % 2 == 0 else ("old", "new")):
                path = paths[which]
                if which == "old" and path is None:
                    continue
                sfx = "" if which == "new" else "_old"
                state = str(self.base / f"fetch-state{sfx}")
                shutil.rmtree(state, ignore_errors=True)
                with path or contextlib.nullcontext():
                    self._tier_only(rec, False)  # no chunk maps of tier copies; an empty cache
                    fetch(f"chunked_cold{sfx}", self.service("chunked", self.chunk_store, state, cache=8 << 30))
                    fetch(f"chunked_warm_cache{sfx}", self.service("chunked", self.chunk_store, state,
                                                                   cache=8 << 30))
                    self._tier_only(rec, True)
                    fetch(f"chunked_tier_chunks{sfx}", self.service("chunked", self.chunk_store,
                                                                    str(self.base / "bench-state")))
                shutil.rmtree(state, ignore_errors=True)
        out: dict[str, Any] = {k: statistics.median(v) for k, v in runs.items()}
        out["runs"] = runs
        for sfx in ("", "_old") if self.args.compare else ("",):
            out[f"speedup_warm_cache{sfx}"] = round(out["whole"] / out[f"chunked_warm_cache{sfx}"], 2)
            out[f"speedup_cold{sfx}"] = round(out["whole"] / out[f"chunked_cold{sfx}"], 2)
        return out

    def restore_only(self, name: str, argv: list[str]) -> dict[str, Any]:
        """--restore-only: --count checkpoints of a workload, each drained chunked (the last also whole), then
        restore()."""
        with self.d.client() as c:
            job = c.run(argv)
        time.sleep(self.args.warmup)
        recs = []
        for i in range(self.args.count):
            if i:
                time.sleep(self.args.interval)
            recs.append(self.checkpoint(job.id))
            chunked = self.drain("chunked", recs[-1])
        whole = self.drain("whole", recs[-1])
        with self.d.client() as c:
            c.stop_job(job.id, kill=True)
        load = os.getloadavg()
        out = {"job": job.id, "logical_bytes": recs[-1].size_bytes, "whole_drain": whole, "chunked_drain": chunked,
               "restore": self.restore(recs),
               "loadavg_before": load, "loadavg_after": os.getloadavg()}
        print(name, json.dumps(out), flush=True)
        return out

    def _tier_only(self, rec: CheckpointRecord, others: bool) -> None:
        for r in self.cat.checkpoints():
            self.cat.update_checkpoint(r.id, in_tier=others and r.id != rec.id)

    def plain_write(self, rec: CheckpointRecord) -> dict[str, Any]:
        """Throughput of a plain write (fsynced) of the checkpoint's bytes into the store's filesystem vs the
        first chunked drain of the same bytes into an empty chunk store (everything new)."""
        src = self.tier.path(rec.id)
        plain_store = self.linked(PosixStore(self.stores / "store-plain", create=True))
        t0 = time.monotonic()
        with plain_store.open_writer("plain-write") as out:  # (fsynced by commit)
            for p in sorted(src.iterdir()):
                with open(p, "rb") as f:
                    while data := f.read(4 * MiB):
                        out.write(data)
            out.commit()
        plain = time.monotonic() - t0
        shutil.rmtree(self.stores / "store-plain", ignore_errors=True)
        fresh = self.linked(PosixStore(self.stores / "store-fresh", create=True))
        svc = self.service("chunked", fresh, str(self.base / "fresh-state"))
        t0 = time.monotonic()
        svc._drain(rec)
        chunked = time.monotonic() - t0
        loose = self.linked(PosixStore(self.stores / "store-fresh-loose", create=True))
        svc_l = self.service("loose", loose, str(self.base / "fresh-state-loose"))
        t0 = time.monotonic()
        svc_l._drain(rec)
        loose_s = time.monotonic() - t0
        shutil.rmtree(self.stores / "store-fresh-loose", ignore_errors=True)
        shutil.rmtree(self.base / "fresh-state-loose", ignore_errors=True)
        svc_w = self.service("whole", self.linked(PosixStore(self.stores / "store-fresh-whole", create=True)))
        t0 = time.monotonic()
        svc_w._drain(rec)
        whole = time.monotonic() - t0
        shutil.rmtree(self.stores / "store-fresh", ignore_errors=True)
        shutil.rmtree(self.stores / "store-fresh-whole", ignore_errors=True)
        shutil.rmtree(self.base / "fresh-state", ignore_errors=True)
        mb = rec.size_bytes / MiB
        return {"bytes": rec.size_bytes, "plain_write_MBps": round(mb / plain), "chunked_first_drain_MBps":
                round(mb / chunked), "whole_drain_MBps": round(mb / whole),
                "chunked_vs_plain": round(plain / chunked, 2), "whole_vs_plain": round(plain / whole, 2),
                "loose_first_drain_MBps": round(mb / loose_s), "loose_vs_plain": round(plain / loose_s, 2),
                "loadavg": os.getloadavg()}

    def second_job(self, argv: list[str]) -> dict[str, Any]:
        with self.d.client() as c:
            job = c.run(argv)
        time.sleep(self.args.warmup)
        rec = self.checkpoint(job.id)
        w, ch, lo = self.drain("whole", rec), self.drain("chunked", rec), self.drain("loose", rec)
        self.whole_store.delete_prefix(rec.id + "/")
        return {"logical_bytes": rec.size_bytes, "whole": w, "chunked": ch, "loose": lo,
                "chunked_over_whole": round(ch["stored_bytes"] / w["stored_bytes"], 3)}


def _mb(n: float) -> str:
    return f"{n / MiB:.1f}"


def render(results: dict[str, Any], title: str) -> str:
    """A markdown report of one run."""
    p = results["params"]
    out = [f"## {title}", "", f"Params: {json.dumps(p)}", ""]
    for name, w in results["workloads"].items():
        out += [f"### {name}", "", "| # | logical MiB | whole stored MiB | whole s | whole ops | chunked stored MiB | "
                "chunked new MiB | chunked s | chunked ops | chunks (new) | loose s | loose ops |", "|---" * 12 + "|"]
        for r in w["checkpoints"]:
            wh, ch, lo = r["whole"], r["chunked"], r.get("loose", {})
            out.append(f"| {r['n']} | {_mb(r['logical_bytes'])} | {_mb(wh['stored_bytes'])} | {wh['seconds']} | "
                       f"{wh['store_ops']} | {_mb(ch['stored_bytes'])} | {_mb(ch['new_bytes'])} | {ch['seconds']} | "
                       f"{ch['store_ops']} | {ch['chunks']} ({ch['new_chunks']}) | {lo.get('seconds', '-')} | "
                       f"{lo.get('store_ops', '-')} |")
        out += ["", "Median from the 2nd checkpoint on: whole/chunked stored bytes "
                f"**{w.get('stored_ratio_from_2nd')}x**, time to durable **{w.get('seconds_ratio_from_2nd')}x**.", ""]
        if "dedup_by_chunk_size" in w:
            out += ["| avg chunk | median new MiB per checkpoint (2nd on) | chunks per checkpoint | chunking MB/s |",
                    "|---|---|---|---|"]
            for k, v in w["dedup_by_chunk_size"].items():
                out.append(f"| {k} | {_mb(v['median_new_from_2nd'])} | {v['chunks_per_checkpoint']} | "
                           f"{v['chunking_MBps']} |")
            out.append("")
        rs = w["restore"]
        out += [f"Restore of the last checkpoint (s): whole {rs['whole']}, chunked cold {rs['chunked_cold']}, "
                f"chunked warm cache {rs['chunked_warm_cache']}, chunked with the other checkpoints' tier copies "
                f"{rs['chunked_tier_chunks']}; warm cache speedup **{rs['speedup_warm_cache']}x**.", ""]
        if "second_job_same_weights" in w:
            sj = w["second_job_same_weights"]
            out += [f"Second job, same weights: whole {_mb(sj['whole']['stored_bytes'])} MiB, chunked "
                    f"{_mb(sj['chunked']['stored_bytes'])} MiB = **{sj['chunked_over_whole'] * 100:.1f}%**.", ""]
        if "throughput" in w:
            t = w["throughput"]
            out += [f"Drain throughput, first checkpoint (all new), {_mb(t['bytes'])} MiB: plain write "
                    f"{t['plain_write_MBps']} MB/s, chunked drain {t['chunked_first_drain_MBps']} MB/s "
                    f"(**{t['chunked_vs_plain']}** of plain), whole drain {t['whole_drain_MBps']} MB/s "
                    f"({t['whole_vs_plain']}), loose chunks {t.get('loose_first_drain_MBps', '-')} MB/s "
                    f"({t.get('loose_vs_plain', '-')}).", ""]
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--weights-mib", type=int, default=1024)
    p.add_argument("--interval", type=float, default=10.0)
    p.add_argument("--count", type=int, default=5)
    p.add_argument("--warmup", type=float, default=8.0)
    p.add_argument("--chunk-size", type=int, default=1 << 20)
    p.add_argument("--only", default="", help="comma-separated workloads (train, infer, counter)")
    p.add_argument("--base", default="/var/tmp/memsnap-bench-chunks")
    p.add_argument("--out", default=str(REPO / "bench/results/chunks.json"))
    p.add_argument("--no-sweep", action="store_true", help="skip the dedup-vs-chunk-size sweep")
    p.add_argument("--link-mbit", type=int, default=0, help="object bytes to and from the stores cross a "
                   "token bucket of this many Mbit/s each way (see Linked)")
    p.add_argument("--threads", type=int, default=ChunkOpts().threads, help="chunk drain worker threads")
    p.add_argument("--netstore", type=int, default=0, metavar="MBIT", help="stores on an sshfs mount over a "
                   "veth limited to MBIT (scripts/bench/netstore.py) instead of the token bucket")
    p.add_argument("--throughput-only", action="store_true", help="only the drain vs plain write comparison")
    p.add_argument("--restore-only", action="store_true", help="only the restore comparison: --count checkpoints "
                   "of each workload, drained chunked (the last also whole), then --repeat rounds of fetches")
    p.add_argument("--repeat", type=int, default=1, help="rounds of restore fetches (medians reported)")
    p.add_argument("--fetch-dir", default="", help="restore fetches write here (default: the memory tier)")
    p.add_argument("--tier-mount", action="store_true", help="the daemon mounts its tier (tier.mount, huge_pages "
                   "within_size); fetches write there too unless --fetch-dir")
    p.add_argument("--compare", default="", metavar="REV", help="also time REV's chunked fetch path (git rev)")
    p.add_argument("--render", nargs="*", help="TITLE=results.json ...: print a markdown report and exit")
    args = p.parse_args()
    if args.render:
        print("\n".join(render(json.loads(Path(f).read_text()), t) for t, f in (a.split("=", 1) for a in args.render)))
        return
    base = Path(args.base)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    net = None
    if args.netstore:  # a real network mount instead of the token bucket: per-request latency counts too
        sys.path.insert(0, str(REPO / "scripts/bench"))
        import netstore

        netstore.NS, netstore.VETH_HOST, netstore.VETH_NS = "mschunk", "mschunk-h", "mschunk-n"
        netstore.HOST_IP, netstore.NS_IP, netstore.PORT = "10.213.79.1", "10.213.79.2", 2224
        net = netstore.NetStore(Path("/var/tmp/memsnap-bench-chunks-net"), args.netstore).setup()
        args.link_mbit = 0
    b = Bench(base, args, net.mount if net else None)
    b.start()
    results: dict[str, Any] = {"params": {k: v for k, v in vars(args).items()}, "workloads": {}}
    if net is not None:
        results["link_check"] = net.check()
    try:
        wl = workloads(args.weights_mib)
        if args.throughput_only:
            with b.d.client() as c:
                job = c.run(wl["infer"])
            time.sleep(args.warmup)
            results["throughput"] = [b.plain_write(b.checkpoint(job.id)) for _ in range(args.count)]
            print(results["throughput"], flush=True)
            Path(args.out).write_text(json.dumps(results, indent=1))
            return
        if args.restore_only:
            for name in (args.only.split(",") if args.only else list(wl)):
                results["workloads"][name] = b.restore_only(name, wl[name])
                for rec in b.cat.checkpoints():
                    b.d.ctl("delete", rec.id)
                Path(args.out).write_text(json.dumps(results, indent=1))
            return
        for name in (args.only.split(",") if args.only else list(wl)):
            r = b.periodic(name, wl[name])
            recs = r.pop("_recs")
            if name == "infer":
                r["second_job_same_weights"] = b.second_job(wl["infer"])
                r["throughput"] = b.plain_write(recs[0])
            results["workloads"][name] = r
            with b.d.client() as c:  # free the tier and the job's memory for the next workload
                c.stop_job(r["job"], kill=True)
                if name == "infer":
                    for j in c.jobs():
                        if j.running:
                            c.stop_job(j.id, kill=True)
            for rec in b.cat.checkpoints():
                b.d.ctl("delete", rec.id)
            Path(args.out).write_text(json.dumps(results, indent=1))
    finally:
        b.d.cleanup()
        if args.tier_mount:
            subprocess.run(["umount", "-l", str(b.d.tier)], check=False)
            b.d.tier.rmdir()
        if net is not None:
            net.teardown()
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
