"""Retention policy: which checkpoints `memsnapctl gc` deletes. Pure logic (no I/O, an injected clock).

A checkpoint belongs to a series: its owner plus its name (checkpoints of a named job carry the job's name,
so a series continues across restores), else its job id, else the pid of the process it was taken of.
Per series, like restic's `forget`, a checkpoint is kept when ANY rule keeps it:

- keep_last N: the N newest checkpoints that are not failed;
- keep_within T: those taken less than T ago;
- always the newest durable checkpoint (the one a restore would fall back to), even with keep_last 0;
- never one that is not durable yet (dumping, staged, draining: the drain owns it), nor a failed one
  (`memsnapctl prune` removes those), nor one the caller says is in use (a restore reads it, a move or a
  park holds it).

A series with neither rule set (the default) keeps everything. Imported by memsnapctl: standard library only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

DURABLE, FAILED = "durable", "failed"  # = memsnap.catalog's state names (not imported: stdlib only here)

# Reasons a checkpoint is kept (GcResponse.kept[].reason, `memsnapctl gc -o wide`).
NO_POLICY = "no retention policy"
KEEP_LAST = "keep-last"
KEEP_WITHIN = "keep-within"
LAST_DURABLE = "last durable checkpoint of its job"
NOT_DURABLE = "not durable yet"
FAILED_KEPT = "failed (memsnapctl prune removes it)"

_DURATION_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|w|d|h|m|s)?", re.IGNORECASE)
_UNIT_S = {"w": 604800.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "": 1.0}
MAX_KEEP_LAST = 1_000_000
MAX_DURATION_S = 100 * 365 * 86400.0


def parse_duration(text: str) -> float:
    """Seconds in '90', '90s', '30m', '2h', '7d', '2w' or a sum of them ('1h30m'); ValueError otherwise."""
    s = text.strip().lower()
    if not s:
        raise ValueError("empty duration: give e.g. 30m, 2h, 7d")
    pos, total = 0, 0.0
    while pos < len(s):
        m = _DURATION_RE.match(s, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"invalid duration {text!r}: use a number with s, m, h, d or w, e.g. 90s, 2h, 1h30m")
        if m.group(2) is None and m.end() != len(s):
            raise ValueError(f"invalid duration {text!r}: only the last number may go without a unit")
        total += float(m.group(1)) * _UNIT_S[(m.group(2) or "").lower()]
        pos = m.end()
    if not math.isfinite(total) or total > MAX_DURATION_S:
        raise ValueError(f"invalid duration {text!r}: at most 100 years")
    return total


def format_duration(seconds: float) -> str:
    """3600 -> '1h', 5400 -> '1h30m', 90 -> '1m30s', 0 -> '0s'."""
    left = int(round(seconds))
    if left == 0:
        return "0s"
    out = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if left >= size:
            out.append(f"{left // size}{unit}")
            left %= size
    return "".join(out)


@dataclass(frozen=True)
class Policy:
    """keep_last / keep_within_s; None = that rule is not set. Both None: keep everything."""

    keep_last: int | None = None
    keep_within_s: float | None = None

    def __post_init__(self) -> None:
        if self.keep_last is not None and not 0 <= self.keep_last <= MAX_KEEP_LAST:
            raise ValueError(f"keep_last {self.keep_last} is out of range 0..{MAX_KEEP_LAST}")
        if self.keep_within_s is not None and not (math.isfinite(self.keep_within_s)
                                                   and 0 <= self.keep_within_s <= MAX_DURATION_S):
            raise ValueError(f"keep_within {self.keep_within_s} s is out of range (0 to 100 years)")

    @property
    def active(self) -> bool:
        """Whether any rule is set (else the series keeps everything)."""
        return self.keep_last is not None or self.keep_within_s is not None

    def over(self, default: Policy) -> Policy:
        """This (a job's) policy, with the default's value for each rule it leaves unset."""
        return Policy(self.keep_last if self.keep_last is not None else default.keep_last,
                      self.keep_within_s if self.keep_within_s is not None else default.keep_within_s)

    def describe(self) -> str:
        """'keep-last 3, keep-within 2h', or 'keep everything'."""
        parts = []
        if self.keep_last is not None:
            parts.append(f"keep-last {self.keep_last}")
        if self.keep_within_s is not None:
            parts.append(f"keep-within {format_duration(self.keep_within_s)}")
        return ", ".join(parts) or "keep everything"

    def to_dict(self) -> dict[str, Any]:
        """For the catalog and JSON output (unset rules are left out)."""
        return {k: v for k, v in (("keep_last", self.keep_last), ("keep_within_s", self.keep_within_s))
                if v is not None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Policy:
        """The inverse of to_dict."""
        kl, kw = d.get("keep_last"), d.get("keep_within_s")
        return cls(None if kl is None else int(kl), None if kw is None else float(kw))


class Ckpt(Protocol):
    """What retention reads of a checkpoint record (memsnap.catalog.CheckpointRecord)."""

    id: str
    state: str
    pid: int
    owner_uid: int
    created_ms: int
    job: str
    name: str
    meta: dict[str, Any]


def series_of(rec: Ckpt) -> str:
    """The series a checkpoint belongs to: 'UID/name:NAME', 'UID/job:ID' or 'UID/pid:PID@START'."""
    if rec.name or rec.job:
        return series_of_job(rec.owner_uid, rec.name, rec.job)
    return f"{rec.owner_uid}/pid:{rec.pid}@{rec.meta.get('pid_start', 0)}"


def series_of_job(owner_uid: int, name: str, job_id: str) -> str:
    """The series of a managed job's checkpoints (a checkpoint of a job carries the job's name)."""
    return f"{owner_uid}/name:{name}" if name else f"{owner_uid}/job:{job_id}"


class Sized(Protocol):
    """The size fields of a checkpoint record."""

    size_bytes: int
    stored_bytes: int
    in_store: bool
    meta: dict[str, Any]


def sizes(rec: Sized) -> tuple[int, int, int]:
    """(logical, stored, new) bytes of a checkpoint: its image (what a restore writes back); what it wrote
    to the store (compressed: its new chunks, bundle and manifest; a whole-file copy: all of it); and the
    image bytes it did not find in the store already (the rest deduplicated; a whole-file copy: all of
    them). The chunked drain records them in meta["store"] (memsnap.store.chunked)."""
    st = rec.meta.get("store") or {}
    logical = int(st.get("logical_bytes") or rec.size_bytes)
    stored = int(rec.stored_bytes or st.get("stored_bytes") or 0)
    if st.get("new_bytes") is not None:
        new = int(st["new_bytes"])
    else:
        new = logical if rec.in_store else 0
    return logical, stored, new


def chunked(rec: Sized) -> bool:
    """Whether the stored copy is chunked (deleting it frees its chunks only once the sweep finds them
    unreferenced)."""
    return (rec.meta.get("store") or {}).get("format") == "chunked"


def not_ours(rec: Ckpt, here: str) -> str:
    """"" when this node (named here) may delete rec's stored copy, else whose it is. One rule for every node that
    shares a store: the node its job moved to (a move's source keeps its row, marked moved_to), else the node that
    made it (meta "home", set when a node adopts another's checkpoint from the store); a node that does not own
    the stored copy only forgets its own row."""
    moved_to = rec.meta.get("moved_to")
    if moved_to:
        return f"its job moved to {moved_to}, which deletes it"
    home = rec.meta.get("home")
    return f"{home} made it and deletes it" if home and home != here else ""


@dataclass
class Plan:
    """What gc does: the ids to delete (oldest first) and why each other checkpoint stays."""

    delete: list[str] = field(default_factory=list)
    keep: dict[str, str] = field(default_factory=dict)


def plan(recs: Iterable[Ckpt], policy_for: Callable[[str], Policy], now_ms: int,
         in_use: Callable[[Ckpt], str] = lambda r: "") -> Plan:
    """Applies each series' policy. policy_for(series) is the effective policy (job's over default);
    in_use(rec) names why a checkpoint must stay whatever the policy says ("" = it may go)."""
    by_series: dict[str, list[Ckpt]] = {}
    for r in recs:
        by_series.setdefault(series_of(r), []).append(r)
    out = Plan()
    doomed: list[tuple[int, str]] = []
    for series, members in sorted(by_series.items()):
        members.sort(key=lambda r: (r.created_ms, r.id), reverse=True)  # newest first
        pol = policy_for(series)
        newest_durable = next((r.id for r in members if r.state == DURABLE), None)
        counted = 0
        for r in members:
            why = _why_kept(r, pol, newest_durable, counted, now_ms, in_use)
            if r.state != FAILED:
                counted += 1
            if why:
                out.keep[r.id] = why
            else:
                doomed.append((r.created_ms, r.id))
    out.delete = [i for _, i in sorted(doomed)]
    return out


def _why_kept(r: Ckpt, pol: Policy, newest_durable: str | None, counted: int, now_ms: int,
              in_use: Callable[[Ckpt], str]) -> str:
    if r.state == FAILED:
        return FAILED_KEPT
    if r.state != DURABLE:
        return f"{NOT_DURABLE} ({r.state})"
    if not pol.active:
        return NO_POLICY
    if r.id == newest_durable:
        return LAST_DURABLE
    if pol.keep_last is not None and counted < pol.keep_last:
        return f"{KEEP_LAST} {pol.keep_last}"
    if pol.keep_within_s is not None and r.created_ms >= now_ms - pol.keep_within_s * 1000:
        return f"{KEEP_WITHIN} {format_duration(pol.keep_within_s)}"
    return in_use(r)


__all__ = ["Ckpt", "Plan", "Policy", "chunked", "format_duration", "not_ours", "parse_duration", "plan",
           "series_of", "series_of_job", "sizes"]
