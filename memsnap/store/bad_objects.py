"""Objects in a store that memsnap skipped because they are not what memsnap writes (memsnap.store.parse).

One bad object (a planted pack, a cut manifest) must never stop the drains, sweeps and restores of everything
else: each reader skips it and reports it here. A report logs one warning per object naming it (kind, key,
why), tells the listeners (the metric memsnap_store_bad_objects_total{kind}), and keeps it for
`memsnapctl status` (root's). A sweep that deletes one forgets it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from memsnap.store.errors import BadObject
from memsnap.store.parse import clip

log = logging.getLogger("memsnap.store")

KINDS = ("pack", "manifest", "sweep-record", "name-index")
_KEEP = 1000  # objects remembered (the oldest go first); the metric counts every one
_WHAT_TO_DO = {
    "pack": "its chunks are not reused from it; gc sweeps it once no manifest references it",
    "manifest": "that checkpoint cannot be restored or adopted from the store, and gc keeps no chunk for it; "
                "delete its directory from the store if no node needs it",
    "sweep-record": "drains check each chunk they reuse in the store once, instead of trusting their index",
    "name-index": "restore by that name ignores the entry; delete it from the store",
}


@dataclass(frozen=True)
class Seen:
    """One bad object: what it is, its key in the store, why it was refused, when it was first seen."""

    kind: str
    key: str
    why: str
    at: float

    def line(self) -> str:
        return f"{self.kind} {self.key}: {self.why}"


class BadObjects:
    """The bad objects this daemon met, once each (by key), newest last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: OrderedDict[str, Seen] = OrderedDict()
        self._listeners: list[Callable[[str], None]] = []

    def subscribe(self, fn: Callable[[str], None]) -> None:
        """fn(kind) runs once for each new bad object."""
        with self._lock:
            self._listeners.append(fn)

    def report(self, kind: str, key: str, why: str, where: str = "") -> bool:
        """Records a bad object (a warning naming it, the first time only); True when it is new."""
        key, why = clip(key, 300), clip(why, 300)
        with self._lock:
            if key in self._seen:
                return False
            self._seen[key] = Seen(kind, key, why, time.time())
            while len(self._seen) > _KEEP:
                self._seen.popitem(last=False)
            listeners = list(self._listeners)
        log.warning("skipped %s %s%s: %s; %s", kind, key, f" in {where}" if where else "", why,
                    _WHAT_TO_DO.get(kind, "it is skipped"))
        for fn in listeners:
            fn(kind)
        return True

    def report_error(self, exc: BadObject, where: str = "") -> bool:
        """report() of a BadObject raised by a parser."""
        return self.report(exc.kind or "object", exc.key, exc.reason, where)

    def forget(self, key: str) -> None:
        """The object is gone from the store (a sweep deleted it)."""
        with self._lock:
            self._seen.pop(clip(key, 300), None)

    def listed(self, limit: int = 20) -> list[str]:
        """'KIND KEY: WHY' of the newest `limit` bad objects."""
        with self._lock:
            return [s.line() for s in list(self._seen.values())[-limit:]][::-1]

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)

    def clear(self) -> None:
        with self._lock:
            self._seen.clear()


BAD = BadObjects()  # the daemon's (one per process, like its log)
