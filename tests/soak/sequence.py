"""Seeded sequences of operations on real programs, with the node checked after every step.

An operation is one thing a user does to a job: checkpoint it, stop and restore it (from the tier, eagerly or
lazily; from the store after an evict), move it (streamed, lazy, via the store), let the memory guard park it
and resume it, or restart a node's daemon under it. After each: the program's own data is intact (programs.py),
and both nodes are healthy (tests.helpers.assert_node_healthy: no CRIU left, drains not paused, nothing frozen,
nothing restorable left over: every checkpoint an operation made is deleted once it served its turn, so any
other is a leftover).
"""

from __future__ import annotations

import json
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.helpers import assert_node_healthy, wait_for
from tests.soak.cluster import Cluster, NodeDaemon
from tests.soak.programs import Program

OPS = ("checkpoint", "stop-restore", "stop-restore-lazy", "store-restore", "store-restore-lazy", "migrate",
       "migrate-lazy", "migrate-via-store", "park-resume", "daemon-restart")


@dataclass
class Result:
    """What one operation did and cost."""

    program: str
    op: str
    ok: bool = True
    seconds: float = 0.0
    frozen_ms: float = 0.0  # CRIU's freeze (checkpoint) or the job's downtime (move, stop+restore)
    downtime_ms: float = 0.0  # the job stopped on one node until it ran again (stop+restore, moves)
    first_answer_ms: float = 0.0  # a client's first answered request after the program came back
    p99_ms: float = 0.0  # the client's request latency, p99, over the operation's check
    error: str = ""
    refused: str = ""  # an operation refused by design (the job untouched, running on): why
    detail: dict[str, Any] = field(default_factory=dict)


def _json(d: NodeDaemon, *args: str, timeout: float = 300) -> dict[str, Any]:
    r = d.ctl("--json", *args, timeout=timeout)
    if r.returncode != 0:
        raise AssertionError(f"memsnapctl {' '.join(args)} on {d.name} failed: {r.stderr.strip()[-2000:]}")
    out: dict[str, Any] = json.loads(r.stdout)
    return out


class Runner:
    """Runs operations on programs of one cluster and keeps every node healthy in between."""

    def __init__(self, cluster: Cluster, programs: list[Program], rng: random.Random,
                 log: Callable[[str], None] = print) -> None:
        self.cluster, self.programs, self.rng, self.log = cluster, programs, rng, log
        self.results: list[Result] = []

    # -- choosing ------------------------------------------------------------------------------------------------
    def possible(self, p: Program) -> list[str]:
        ops = [o for o in OPS if o != "park-resume" or p.parkable]
        return ops

    def step(self, p: Program, op: str = "") -> Result:
        op = op or self.rng.choice(self.possible(p))
        res = Result(p.name, op)
        t0 = time.monotonic()
        try:
            p.quiesce()
            kept = getattr(self, "_" + op.replace("-", "_"))(p, res)
            stats = p.check(kept)
            if stats:
                res.p99_ms = stats.get("p99_ms", 0.0)
            self.healthy()
        except Exception as exc:
            res.ok, res.error = False, f"{type(exc).__name__}: {exc}"
            raise
        finally:
            res.seconds = time.monotonic() - t0
            self.results.append(res)
            verdict = "FAILED" if not res.ok else "refused" if res.refused else "ok"
            self.log(f"{res.program:12} {res.op:20} {verdict} {res.seconds:6.1f} s"
                     + (f" frozen {res.frozen_ms:.0f} ms" if res.frozen_ms else "")
                     + (f" downtime {res.downtime_ms:.0f} ms" if res.downtime_ms else "")
                     + (f" first answer {res.first_answer_ms:.0f} ms" if res.first_answer_ms else "")
                     + (f" {res.error[:300]}" if res.error else ""))
        return res

    def healthy(self) -> None:
        """Both nodes: no CRIU left, drains not paused, nothing frozen, nothing restorable left over."""
        for d in self.cluster.nodes:
            pids = [p.pid for p in self.programs if p.node is d and p.pid]
            assert_node_healthy(d, restorable=set(), jobs=pids, settle_s=60)

    # -- helpers -------------------------------------------------------------------------------------------------
    def _tcp(self, p: Program) -> list[str]:
        return ["--tcp-established"] if p.tcp else []

    def _forget(self, d: NodeDaemon, *ckpts: str) -> None:
        """Deletes checkpoints that served their turn (waits for a lazy restore still reading one)."""
        for ck in ckpts:
            def gone(ck: str = ck) -> bool:
                r = d.ctl("delete", ck)
                return r.returncode == 0 or "no checkpoint" in r.stderr
            wait_for(gone, 120, 0.5, f"{ck} to be deletable on {d.name}")

    def _restored(self, p: Program, d: NodeDaemon, out: dict[str, Any]) -> None:
        p.adopt(d, out["job"], int(out["pid"]))

    # -- the operations (each returns whether the client's connections were to be kept) ---------------------------
    def _checkpoint(self, p: Program, res: Result) -> bool:
        assert p.node is not None
        ck = _json(p.node, "checkpoint", p.job, *self._tcp(p))
        res.frozen_ms = float(ck.get("frozen_ms", 0))
        self._forget(p.node, ck["id"])
        return p.tcp

    def _stop_then(self, p: Program, res: Result, *restore_flags: str, from_store: bool = False) -> bool:
        assert p.node is not None
        d = p.node
        t0 = time.monotonic()
        wait = ["--wait", "durable"] if from_store else []
        ck = _json(d, "checkpoint", p.job, "--stop", *wait, *self._tcp(p))
        res.frozen_ms = float(ck.get("frozen_ms", 0))
        if from_store:
            d.ctl("evict", ck["id"], check=True)
        t1 = time.monotonic()
        out = _json(d, "restore", *restore_flags, *self._tcp(p), ck["id"])
        res.downtime_ms = (time.monotonic() - t0) * 1000
        res.detail["restore_ms"] = (time.monotonic() - t1) * 1000
        self._restored(p, d, out)
        res.first_answer_ms = p.first_answer() * 1000
        self._forget(d, ck["id"])
        return p.tcp

    def _stop_restore(self, p: Program, res: Result) -> bool:
        return self._stop_then(p, res)

    def _stop_restore_lazy(self, p: Program, res: Result) -> bool:
        return self._stop_then(p, res, "--lazy")

    def _store_restore(self, p: Program, res: Result) -> bool:
        return self._stop_then(p, res, from_store=True)

    def _store_restore_lazy(self, p: Program, res: Result) -> bool:
        return self._stop_then(p, res, "--lazy", from_store=True)

    def _move(self, p: Program, res: Result, *flags: str) -> bool:
        assert p.node is not None
        src, dst = p.node, self.cluster.other(p.node)
        lazy = "--lazy" in flags
        net = ["--move-ip", f"{p.service_ip}/24"] if p.tcp else []
        keep = p.tcp and not lazy
        try:
            out = _json(src, "migrate", p.job, "--to", dst.name, *flags, *net,
                        *(["--tcp-established"] if keep else []), timeout=600)
        except AssertionError as exc:
            # By design on one host (README, known limits): the copy there cannot take a lock its stopped original
            # holds on a file both nodes see; the move rolls back and the job runs on here, its data intact.
            if "conflicting lock" in str(exc) and "resumed on this node" in str(exc):
                res.refused = "the job held a lock on a file both nodes share"
                return keep
            raise
        res.downtime_ms = float(out.get("downtime_ms", 0))
        res.detail["phases"] = out.get("phases", {})
        p.adopt(dst, out["target_job"], int(out["target_pid"]))
        res.first_answer_ms = p.first_answer() * 1000
        # The moved job's image on the target (and a durable one left on the source) served its turn.
        self._forget(dst, out["checkpoint"])
        self._forget(src, out["checkpoint"])
        return keep

    def _migrate(self, p: Program, res: Result) -> bool:
        return self._move(p, res)

    def _migrate_lazy(self, p: Program, res: Result) -> bool:
        return self._move(p, res, "--lazy")

    def _migrate_via_store(self, p: Program, res: Result) -> bool:
        return self._move(p, res, "--via-store")

    def _park_resume(self, p: Program, res: Result) -> bool:
        assert p.node is not None and p.memory_limit
        d = p.node
        usage = _cgroup_usage(p.pid)
        t0 = time.monotonic()
        p.grow(max(32, (p.memory_limit - usage) // (1 << 20) + 32))
        try:
            parked = wait_for(lambda: _job_state(d, p.job) == "parked", 240, 0.2, f"{p.name} to be parked")
        except AssertionError as exc:
            said = [ln for ln in d.log.read_text(errors="replace").splitlines() if "park" in ln][-5:]
            raise AssertionError(f"{exc}; the guard said: {said}") from exc
        res.detail["park_s"] = time.monotonic() - t0
        assert parked
        p.memory_limit += 512 << 20
        out = _json(d, "resume", p.job, "--memory-limit", f"{p.memory_limit >> 20}M")
        res.downtime_ms = (time.monotonic() - t0) * 1000
        self._restored(p, d, out)
        rows = json.loads(d.ctl("--json", "list", check=True).stdout)
        self._forget(d, *[c["id"] for c in rows if c.get("job") in (out["resumed"], out["job"])
                          and c["state"] in ("staged", "draining", "durable")])
        return False

    def _daemon_restart(self, p: Program, res: Result) -> bool:
        assert p.node is not None
        sig = self.rng.choice([signal.SIGTERM, signal.SIGKILL])
        res.detail["signal"] = sig.name
        t0 = time.monotonic()
        p.node.restart(sig)
        res.downtime_ms = 0.0  # (the jobs run on: they are not the daemon's children)
        res.detail["restart_s"] = time.monotonic() - t0
        return p.tcp


def _job_state(d: NodeDaemon, job: str) -> str:
    for j in json.loads(d.ctl("--json", "jobs", check=True).stdout):
        if j["id"] == job:
            return str(j.get("guard_state") or ("running" if j.get("running") else "ended"))
    return ""


def _cgroup_usage(pid: int) -> int:
    """Bytes the memory cgroup of pid uses (cgroup v1 or v2)."""
    from pathlib import Path

    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, ctrl, path = line.split(":", 2)
        if "memory" in ctrl.split(","):
            return int(Path(f"/sys/fs/cgroup/memory{path}/memory.usage_in_bytes").read_text())
        if ctrl == "":
            f = Path(f"/sys/fs/cgroup{path}/memory.current")
            if f.exists():
                return int(f.read_text())
    return 0


def summary(results: list[Result]) -> dict[str, Any]:
    """Counts, failures and medians/p99 per operation, for bench/results."""
    def q(xs: list[float], p: float) -> float:
        xs = sorted(xs)
        return round(xs[min(len(xs) - 1, int(p * len(xs)))], 1) if xs else 0.0

    by_op: dict[str, Any] = {}
    for op in sorted({r.op for r in results}):
        rs = [r for r in results if r.op == op]
        row: dict[str, Any] = {"runs": len(rs), "failed": sum(not r.ok for r in rs),
                               "refused": sum(bool(r.refused) for r in rs)}
        for k in ("seconds", "frozen_ms", "downtime_ms", "first_answer_ms", "p99_ms"):
            xs = [getattr(r, k) for r in rs if getattr(r, k)]
            if xs:
                row[k] = {"median": q(xs, 0.5), "p99": q(xs, 0.99), "max": q(xs, 1.0)}
        by_op[op] = row
    return {"operations": len(results), "failed": sum(not r.ok for r in results),
            "refused": sum(bool(r.refused) for r in results), "by_op": by_op}
