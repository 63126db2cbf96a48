"""Logging setup for memsnapd: text or JSON lines, with checkpoint ids carried on every line."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from typing import IO, Any

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD_ATTRS = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", None, None)).keys() | {"message", "asctime", "taskName"}
)
_OURS = "_memsnap_handler"


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    """Fields passed through `extra=` (checkpoint_id, job, pid, ...)."""
    return {k: v for k, v in vars(record).items() if k not in _STANDARD_ATTRS and not k.startswith("_")}


def _timestamp(record: logging.LogRecord) -> str:
    """RFC 3339 UTC timestamp with milliseconds."""
    moment = datetime.fromtimestamp(record.created, tz=UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _positional_args(record: logging.LogRecord) -> tuple[Any, ...]:
    # logging turns a lone dict argument into record.args itself (for "%(key)s" messages)
    if isinstance(record.args, dict) and "%(" not in str(record.msg):
        return (record.args,)
    return record.args if isinstance(record.args, tuple) else ()


def _structured_args(record: logging.LogRecord) -> list[Any]:
    """The dict/list arguments of a %-style message: JSON lines carry them as data, not as reprs."""
    return [a for a in _positional_args(record) if isinstance(a, (dict, list, tuple))]


def _message(record: logging.LogRecord) -> str:
    """The message, with dict/list arguments written as JSON instead of Python reprs."""
    positional = _positional_args(record)
    if any(isinstance(a, (dict, list, tuple)) for a in positional):
        args = tuple(json.dumps(a, default=str, sort_keys=True) if isinstance(a, (dict, list, tuple)) else a
                     for a in positional)
        try:
            return str(record.msg) % args
        except (TypeError, ValueError):
            pass
    return record.getMessage()


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, extras, and exc when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        """Render record as a JSON line."""
        entry: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": _message(record),
        }
        structured = _structured_args(record)
        if structured:
            entry["args"] = structured
        for key, value in _extras(record).items():
            entry.setdefault(key, value)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """Human-readable lines: `ts LEVEL logger [ckpt=<id>] msg key=value ...`."""

    def format(self, record: logging.LogRecord) -> str:
        """Render record as one text line (plus any traceback)."""
        extras = _extras(record)
        parts = [_timestamp(record), record.levelname, record.name]
        ckpt = extras.pop("checkpoint_id", None)
        if ckpt is not None:
            parts.append(f"ckpt={ckpt}")
        parts.append(record.getMessage())
        parts += [f"{key}={value}" for key, value in extras.items()]
        line = " ".join(str(p) for p in parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


def setup_logging(fmt: str = "text", level: str | int = "info", stream: IO[str] | None = None) -> None:
    """Send the root logger to stream (stderr) in "text" or "json" format at level."""
    if fmt not in ("text", "json"):
        raise ValueError(f'log format must be "text" or "json", got {fmt!r}')
    numeric = level if isinstance(level, int) else logging.getLevelNamesMapping().get(level.upper())
    if numeric is None:
        raise ValueError(f"unknown log level {level!r}")
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _OURS, False)]:
        root.removeHandler(old)  # only ours: leave handlers others installed (e.g. pytest's)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    setattr(handler, _OURS, True)
    root.addHandler(handler)
    root.setLevel(numeric)


class Quieted:
    """Warnings that an outsider can cause at will (a stranger on the TCP port or the image channel): each kind
    (its message template) at most once every interval_s. The others are counted, and the next line of the kind
    says how many were left out. A scanner or a flood of bad calls then costs the node's log a line per kind per
    interval, not a line per connection (a shared node's disk, and the lines that matter among them)."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log, self._interval, self._clock = logger, interval_s, clock
        self._lock = threading.Lock()
        self._next: dict[str, float] = {}
        self._held: Counter[str] = Counter()

    def warning(self, msg: str, *args: object) -> None:
        now = self._clock()
        with self._lock:
            if msg in self._next and now < self._next[msg]:
                self._held[msg] += 1
                return
            self._next[msg] = now + self._interval
            held = self._held.pop(msg, 0)
        if held:
            msg, args = msg + " (%d more like it left out since the last)", (*args, held)
        self._log.warning(msg, *args)
