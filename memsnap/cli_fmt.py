"""Output helpers for memsnapctl: sizes, durations, ages, tables, YAML and progress lines.

Only the standard library: memsnapctl imports this before it knows whether it needs gRPC at all.
"""

from __future__ import annotations

import json
import re
import time
from typing import IO, Any, cast

# What a terminal acts on instead of printing: C0 controls (newline, CR, ESC, ...), DEL, C1 (0x80-0x9f: CSI, OSC
# in 8-bit form), and Unicode's bidirectional overrides, isolates, marks and line separators.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    return _SHORT.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def printable(text: object) -> str:
    """text as one line a terminal shows as it is: the controls in it escaped (a newline as \\n, ESC as \\x1b,
    a bidi override as \\u202e). Everything a user named (job names, commands, paths, CRIU's and the daemon's
    messages) goes through it on its way to a human; -o json and -o yaml keep the exact strings (escaped
    their own way)."""
    s = str(text)
    return _UNPRINTABLE.sub(_escape, s) if _UNPRINTABLE.search(s) else s


def printable_lines(text: str) -> str:
    """printable() of each line of text: its newlines stay, every other control is escaped."""
    return "\n".join(printable(line) for line in text.split("\n"))


def printable_stream(stream: Any) -> IO[Any]:
    """stream, writing printable_lines() of what it is given (for click's own messages, which quote input)."""
    return cast(IO[Any], _PrintableStream(stream))


class _PrintableStream:

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return int(self._stream.write(printable_lines(text)))

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return bool(self._stream.isatty())


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_ms(ms: float) -> str:
    """138 -> '138 ms', 2500 -> '2.5 s', 125000 -> '2m5s'."""
    if ms < 1000:
        return f"{ms:.0f} ms"
    return human_s(ms / 1000)


def human_s(s: float) -> str:
    """Seconds as '2.5 s', '4m10s', '3h02m' or '2d3h'."""
    if s < 60:
        return f"{s:.1f} s"
    s = int(s)
    if s < 3600:
        return f"{s // 60}m{s % 60}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600}h"


def age(unix_ms: int, now: float | None = None) -> str:
    """How long ago a millisecond timestamp was, like kubectl's AGE column ('5s', '3m', '2h', '4d')."""
    if not unix_ms:
        return "-"
    s = max(0, int((now if now is not None else time.time()) - unix_ms / 1000))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def timestamp(unix_ms: int) -> str:
    """Local wall time of a millisecond timestamp, or '-'."""
    if not unix_ms:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix_ms / 1000))


def table(rows: list[list[str]], header: list[str]) -> str:
    """Left-aligned columns separated by two spaces, header in capitals; one line per row, every cell
    printable()."""
    rows = [[printable(c) for c in r] for r in rows]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*[str(c) for c in r]).rstrip() for r in [header, *rows])


def to_json(data: Any) -> str:
    """One line of JSON with sorted keys (the --json format scripts parse)."""
    return json.dumps(data, sort_keys=True)


def _yaml_scalar(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    s = str(v)
    plain = s and s.strip() == s and not any(c in s for c in ":#{}[],&*!|>'\"%@`\n") and not _UNPRINTABLE.search(s) \
        and s.lower() not in ("true", "false", "null", "yes", "no", "~") and not _numeric(s) \
        and s[0] not in "-?"
    return s if plain else json.dumps(s)


def _numeric(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def to_yaml(data: Any, indent: int = 0) -> str:
    """A small YAML writer for JSON-like data (dicts, lists, scalars): enough for -o yaml."""
    pad = " " * indent
    if isinstance(data, dict):
        if not data:
            return pad + "{}"
        out = []
        for k in sorted(data):
            v = data[k]
            if isinstance(v, (dict, list)) and v:
                out.append(f"{pad}{_yaml_scalar(k)}:")
                out.append(to_yaml(v, indent + 2))
            else:
                out.append(f"{pad}{_yaml_scalar(k)}: {to_yaml(v, 0).strip()}")
        return "\n".join(out)
    if isinstance(data, list):
        if not data:
            return pad + "[]"
        out = []
        for item in data:
            body = to_yaml(item, indent + 2)
            if isinstance(item, (dict, list)) and item:
                out.append(f"{pad}- {body.lstrip()}")
            else:
                out.append(f"{pad}- {body.strip()}")
        return "\n".join(out)
    return pad + _yaml_scalar(data)


class Progress:
    """A progress display: a redrawn bar with rate and ETA on a terminal, plain lines otherwise.

    On a non-terminal a line is written only when the state changes or another quarter is done, so a
    log file gets a handful of lines, never carriage-return frames.
    """

    def __init__(self, label: str, stream: Any, tty: bool) -> None:
        self.label, self.stream, self.tty = label, stream, tty
        self.t0 = time.monotonic()
        self.samples: list[tuple[float, float]] = []
        self._last_plain: tuple[str, int] = ("", -1)
        self._drew = False

    def rate(self, done: float) -> float:
        """Bytes per second over the last few seconds."""
        now = time.monotonic()
        self.samples.append((now, done))
        self.samples = [s for s in self.samples if now - s[0] <= 5.0] or [(now, done)]
        t_first, d_first = self.samples[0]
        if now - t_first < 0.2:
            return (done / (now - self.t0)) if now - self.t0 > 0.2 else 0.0
        return (done - d_first) / (now - t_first)

    def line(self, done: float, total: float, state: str, note: str = "") -> str:
        """The text of one update (without carriage returns)."""
        frac = min(1.0, done / total) if total > 0 else 0.0
        rate = self.rate(done)
        eta = f" ETA {human_s((total - done) / rate)}" if rate > 0 and 0 < frac < 1 else ""
        bar = "#" * int(frac * 30)
        speed = f" {human_bytes(rate)}/s" if rate > 0 and frac < 1 else ""
        tail = f"  {note}" if note else ""
        return printable(f"{self.label} [{bar:<30}] {frac * 100:5.1f}% {human_bytes(done)}/{human_bytes(total)}"
                         f"{speed}{eta} {state}{tail}")

    def update(self, done: float, total: float, state: str, note: str = "") -> None:
        """Shows one update."""
        text = self.line(done, total, state, note)
        if self.tty:
            self.stream.write("\r" + text + "\033[K")
            self._drew = True
        else:
            quarter = int(min(1.0, done / total) * 4) if total > 0 else 0
            key = (state + note, quarter)
            if key == self._last_plain:
                return
            self._last_plain = key
            self.stream.write(text + "\n")
        self.stream.flush()

    def spin(self, what: str) -> None:
        """An update without a byte count: elapsed time only (terminals only)."""
        if self.tty:
            self.stream.write(f"\r{printable(what)} ... {human_s(time.monotonic() - self.t0)}\033[K")
            self.stream.flush()
            self._drew = True

    def done(self) -> None:
        """Ends the bar's line."""
        if self.tty and self._drew:
            self.stream.write("\n")
            self.stream.flush()
