"""Per-uid quotas ([quota] in memsnap.toml, docs/quota.md): memory tier bytes, store bytes, running jobs and
checkpoints, so that one user cannot fill a shared node and root's own checkpoint still finds room.

A request is admitted before any work starts (before a dump freezes anything, before a job is launched,
before a restore fetches into the tier):

    usage(uid)  = what the uid owns in this node's catalog            (read at each request)
                + what its admitted requests still in flight will add  (so two at once cannot both squeeze in)
    usage + need > limit  ->  RESOURCE_EXHAUSTED, one line: which limit, the usage, how to free room
                              (tier bytes: its own durable tier copies are evicted first, LRU, as the tier does)

Only a caller's own things are limited: root acting on another uid's job (Slurm hooks, the memory guard,
moves arriving from peers) is not. A uid's limits are its [quota.uid.UID] keys, else [quota]'s; root gets
[quota]'s never, only its own table's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from memsnap.catalog import DURABLE, RESTORABLE, Catalog, CheckpointRecord, JobRecord
from memsnap.cli_fmt import human_bytes
from memsnap.config import QuotaConfig, UidQuota
from memsnap.engine import ROOT, Caller
from memsnap.errors import MemsnapError, NotFound, QuotaExceeded
from memsnap.retention import sizes

log = logging.getLogger("memsnap.quota")

RESOURCES = ("tier_bytes", "store_bytes", "jobs", "checkpoints")


@dataclass
class Usage:
    """What a uid uses (or a request needs): bytes of tier copies and of stored copies, running jobs, and
    restorable checkpoints."""

    tier_bytes: int = 0
    store_bytes: int = 0
    jobs: int = 0
    checkpoints: int = 0

    def plus(self, other: Usage, sign: int = 1) -> Usage:
        """This plus (sign=-1: minus) other, resource by resource."""
        return Usage(*(getattr(self, r) + sign * getattr(other, r) for r in RESOURCES))


@dataclass(frozen=True)
class Limit:
    """One limit and the config key that set it (quota.jobs, quota.uid.1000.jobs), for the refusal's line."""

    value: int
    key: str


class QuotaHost(Protocol):
    """What quotas need from the engine (memsnap.engine.Engine)."""

    catalog: Catalog

    def resolve_pid(self, target: str, caller: Caller = ROOT) -> tuple[int, JobRecord | None]:
        """A pid, job id or name -> (live pid, its job), authorized for a job."""
        ...

    def dump_estimate(self, pid: int) -> int:
        """The tier room a dump of pid's tree reserves."""
        ...

    def latest_restorable(self, caller: Caller, key: str) -> CheckpointRecord:
        """The checkpoint a restore of key would use, authorized."""
        ...

    def evict(self, caller: Caller, ckpt_id: str) -> CheckpointRecord:
        """Drops the tier copy of a durable checkpoint."""
        ...

    def tier_copy_in_use(self, ckpt_id: str) -> bool:
        """Whether a restore still reads this tier copy."""
        ...


def usage_of(checkpoints: Iterable[CheckpointRecord], jobs: Iterable[JobRecord],
             running: Callable[[JobRecord], bool]) -> dict[int, Usage]:
    """Usage per owner uid: tier copies (not a park image in the guard's spill dir) of any state, stored bytes of
    durable checkpoints, running jobs, restorable checkpoints."""
    out: dict[int, Usage] = {}
    for r in checkpoints:
        u = out.setdefault(r.owner_uid, Usage())
        if r.in_tier and not r.meta.get("spill"):
            u.tier_bytes += r.size_bytes
        if r.state == DURABLE and r.in_store:
            u.store_bytes += sizes(r)[1]
        if r.state in RESTORABLE:
            u.checkpoints += 1
    for j in jobs:
        if not j.ended and running(j):
            out.setdefault(j.owner_uid, Usage()).jobs += 1
    return out


def _alive(j: JobRecord) -> bool:
    from memsnap import proc

    return proc.alive(j.pid, j.pid_start)


class Quotas:
    """Admits (or refuses) a uid's requests against its limits; reports usage per uid (Status, metrics)."""

    def __init__(self, default: QuotaConfig, uids: tuple[UidQuota, ...], host: QuotaHost,
                 running: Callable[[JobRecord], bool] = _alive) -> None:
        self.default = default
        self.uids = {q.uid: dict(q.limits) for q in uids}
        self.host = host
        self.running = running
        self._lock = threading.Lock()
        self._pending: dict[int, Usage] = {}  # admitted requests still in flight, by uid

    def limits(self, uid: int) -> dict[str, Limit]:
        """uid's limits, by resource (a resource without one is left out)."""
        own = self.uids.get(uid, {})
        out = {}
        for r in RESOURCES:
            if r in own:
                value, key = own[r], f"quota.uid.{uid}.{r}"
            elif uid != 0:
                value, key = getattr(self.default, r), f"quota.{r}"
            else:
                continue
            if value is not None:
                out[r] = Limit(value, key)
        return out

    def usage(self) -> dict[int, Usage]:
        """Usage per uid, from the catalog."""
        c = self.host.catalog
        return usage_of(c.checkpoints(), c.jobs(), self.running)

    def report(self, caller: Caller) -> list[tuple[int, Usage, dict[str, Limit]]]:
        """(uid, usage, limits) of every uid for root (those that use something or have limits of their own,
        and root), of the caller's own uid for anyone else."""
        usage = self.usage()
        uids = {0, *usage, *self.uids} if caller.is_root else {caller.uid}
        return [(u, usage.get(u, Usage()), self.limits(u)) for u in sorted(uids)]

    # -- admission ------------------------------------------------------------------------------------
    @contextmanager
    def admit_job(self, caller: Caller) -> Iterator[None]:
        """Around launching a job as caller."""
        with self._admit(caller.uid, Usage(jobs=1)):
            yield

    @contextmanager
    def admit_checkpoint(self, caller: Caller, target: str) -> Iterator[None]:
        """Around a checkpoint of target by caller: one more checkpoint, and the tier room its dump reserves."""
        if not self.limits(caller.uid):
            yield
            return
        pid, job = self.host.resolve_pid(target, caller)
        if job is not None:
            owner = job.owner_uid
        else:
            from memsnap import proc

            try:
                owner = proc.owner_uid(pid)
            except proc.ProcessNotFound as exc:
                raise NotFound(str(exc)) from exc
        if owner != caller.uid:  # root on another uid's process (the engine refuses anyone else)
            yield
            return
        with self._admit(owner, Usage(tier_bytes=self.host.dump_estimate(pid), checkpoints=1)):
            yield

    @contextmanager
    def admit_restore(self, caller: Caller, key: str, lazy: bool = False) -> Iterator[None]:
        """Around a restore of key by caller: one more job, and the checkpoint's size when it is fetched into the
        tier (not for a tier copy, nor a lazy restore, which pages in from the store)."""
        if not self.limits(caller.uid):
            yield
            return
        rec = self.host.latest_restorable(caller, key)
        if rec.owner_uid != caller.uid:
            yield
            return
        need = Usage(jobs=1, tier_bytes=0 if rec.in_tier or lazy else rec.size_bytes)
        with self._admit(rec.owner_uid, need, keep=rec.id):
            yield

    @contextmanager
    def _admit(self, uid: int, need: Usage, keep: str = "") -> Iterator[None]:
        limits = self.limits(uid)
        if not limits:
            yield
            return
        for attempt in (1, 2):
            with self._lock:
                used = self.usage().get(uid, Usage()).plus(self._pending.get(uid, Usage()))
                over = _over(used, need, limits)
                if not over:
                    self._pending[uid] = self._pending.get(uid, Usage()).plus(need)
                    break
            short = used.tier_bytes + need.tier_bytes - limits["tier_bytes"].value if over == "tier_bytes" else 0
            if attempt == 2 or not short or not self._evict_for(uid, short, keep):
                log.info("refused: %s", over, extra={"uid": uid})
                raise QuotaExceeded(refusal(uid, over, used, need, limits[over]))
        try:
            yield
        finally:
            with self._lock:
                left = self._pending[uid].plus(need, -1)
                if left == Usage():
                    del self._pending[uid]
                else:
                    self._pending[uid] = left

    def _evict_for(self, uid: int, nbytes: int, keep: str) -> bool:
        """Evicts uid's durable tier copies, least recently used first, until nbytes are freed; evicts nothing when
        that cannot free enough. Whether it freed enough."""
        cands = sorted((r for r in self.host.catalog.checkpoints(states=(DURABLE,))
                        if r.owner_uid == uid and r.in_tier and r.in_store and r.id != keep
                        and not r.meta.get("spill") and not self.host.tier_copy_in_use(r.id)),
                       key=lambda r: (r.last_used_ms or r.created_ms, r.id))
        if sum(r.size_bytes for r in cands) < nbytes:
            return False
        freed = 0
        for r in cands:
            if freed >= nbytes:
                break
            try:
                self.host.evict(ROOT, r.id)
            except MemsnapError as exc:  # a restore started reading it meanwhile, or it was deleted
                log.info("quota: could not evict %s: %s", r.id, exc, extra={"uid": uid})
                continue
            log.info("evicted %s's tier copy: uid %d is at its tier quota", r.id, uid, extra={"uid": uid})
            freed += r.size_bytes
        return freed >= nbytes


def _over(used: Usage, need: Usage, limits: dict[str, Limit]) -> str:
    """The first resource need would take past its limit ("" = none). A checkpoint may not start while the
    store already holds the uid's limit (how much it will store is known only once drained)."""
    def past(r: str) -> bool:
        return r in limits and getattr(used, r) + getattr(need, r) > limits[r].value

    if need.checkpoints and past("checkpoints"):
        return "checkpoints"
    if need.jobs and past("jobs"):
        return "jobs"
    if need.checkpoints and "store_bytes" in limits and used.store_bytes >= limits["store_bytes"].value:
        return "store_bytes"
    if need.tier_bytes and past("tier_bytes"):
        return "tier_bytes"
    return ""


def refusal(uid: int, over: str, used: Usage, need: Usage, limit: Limit) -> str:
    """The one line a refused request gets: the limit, the usage, and how to free room."""
    ask = "or ask the administrator for more"
    if over == "checkpoints":
        return (f"uid {uid} has {used.checkpoints} of {limit.value} checkpoints ({limit.key}): delete one "
                f"('memsnapctl delete ID' or 'memsnapctl gc') {ask}")
    if over == "jobs":
        return f"uid {uid} runs {used.jobs} of {limit.value} jobs ({limit.key}): stop one ('memsnapctl stop JOB') {ask}"
    if over == "store_bytes":
        return (f"uid {uid} has {human_bytes(used.store_bytes)} of {human_bytes(limit.value)} in the store "
                f"({limit.key}): delete checkpoints ('memsnapctl delete ID' or 'memsnapctl gc') {ask}")
    have = (f"uid {uid} has {human_bytes(used.tier_bytes)} of {human_bytes(limit.value)} in the memory tier "
            f"({limit.key}) and this needs about {human_bytes(need.tier_bytes)} more")
    if need.tier_bytes > limit.value:
        return f"{have}, more than the whole quota: ask the administrator for more"
    return (f"{have}: delete checkpoints ('memsnapctl delete ID'), evict durable ones ('memsnapctl evict ID'; "
            f"'memsnapctl watch ID' follows a drain) {ask}")


__all__ = ["Limit", "QuotaHost", "Quotas", "RESOURCES", "Usage", "refusal", "usage_of"]
