#!/usr/bin/env python3
"""Sorts surviving mutants (mutmut show diffs on stdin, as scripts/mutation.sh writes them) into classes:

  message   only the text of an error or log message changed (the decision and its error class stay)
  review    anything else: a decision may have changed; each one needs a test or a sentence in docs/mutation.md

    python3 scripts/mutation_triage.py < bench/results/mutation.diff
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict

STRING = re.compile(r"""(?:[rbfu]{0,2})("([^"\\]|\\.)*"|'([^'\\]|\\.)*')""")
MESSAGE_LINE = re.compile(r"raise |Error\(|log\.|clog\.|warning\(|\.info\(|\.error\(|InvalidArgument\(|NotFound\("
                          r"|PermissionDenied\(|FailedPrecondition\(|Unavailable\(|UnsafePath\(|_refuse\(|abort\(")


def _message_line(line: str) -> bool:
    """A line of an error or log message: the call itself, or a string continuation line of one."""
    stripped = line.lstrip()
    return bool(MESSAGE_LINE.search(line)) or stripped.startswith(('"', "'", 'f"', "f'"))


def classify(removed: list[str], added: list[str]) -> str:
    if not removed or len(removed) != len(added) or not all(_message_line(r) for r in removed):
        return "review"
    if all(STRING.sub('""', r) == STRING.sub('""', a) for r, a in zip(removed, added, strict=True)):
        return "message"  # only string literals changed, in a message
    # A changed expression inside an f-string's {...} of a message (e.g. got[1] for got[0]).
    for r, a in zip(removed, added, strict=True):
        i = min((k for k in (r.find('f"'), r.find("f'")) if k >= 0), default=-1)
        if i < 0 or r[:i] != a[:i]:
            return "review"
    return "message"


def main() -> None:
    text = sys.stdin.read()
    blocks = re.split(r"^# (\S+__mutmut_\d+): (?:survived|no tests)\n", text, flags=re.M)
    out: dict[str, list[str]] = defaultdict(list)
    for name, body in zip(blocks[1::2], blocks[2::2], strict=True):
        removed = [ln[1:] for ln in body.splitlines() if ln.startswith("-") and not ln.startswith("---")]
        added = [ln[1:] for ln in body.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
        out[classify(removed, added)].append(name)
    for cls in ("message", "review"):
        print(f"{cls}: {len(out[cls])}")
        for n in out[cls]:
            print(f"  {n}")


if __name__ == "__main__":
    main()
