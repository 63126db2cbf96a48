"""What a CRIU log says: its decisive error lines, and what they mean for a user."""

from __future__ import annotations

import re
from pathlib import Path

# CRIU logs this on every run on a node where root lacks CAP_SYS_RESOURCE; it never matters.
HARMLESS = re.compile(r"RLIMIT_NOFILE")


def error_lines(log_path: str | Path, limit: int = 3) -> list[str]:
    """The useful 'Error (' lines of a CRIU log, without the harmless RLIMIT_NOFILE noise."""
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return []
    lines = [re.sub(r"^\(\d+\.\d+\)\s*", "", ln.strip()) for ln in text.splitlines()
             if "Error (" in ln and not HARMLESS.search(ln)]
    if not lines:
        return []
    # CRIU logs a cascade: the first line that is not a mere consequence says why; keep it first, then
    # the last lines (where it gave up).
    cause = next((ln for ln in lines if not _CONSEQUENCE.search(ln)), lines[-1])
    return [cause, *[ln for ln in lines if ln != cause][-(limit - 1):]] if limit > 1 else [cause]


# Error lines that only report that something earlier failed.
_CONSEQUENCE = re.compile(r"Restoring FAILED|Dumping FAILED|exited, status=|Unable to open fd=|"
                          r"Pre-dumping FAILED|Failed to restore|"
                          r"Unable to (?:restore|dump)|Collect.*failed|Failed to dump")
# What to do about a decisive line, in words a user can act on.
_HINTS = (
    (re.compile(r"has bad size|bad size"), "a file the job has open (its log?) changed since the checkpoint "
                                           "was taken; CRIU restores open files only as they were"),
    (re.compile(r"on restore: No such file"), "a file the job had open is gone"),
    (re.compile(r"Address already in use"), "a port the job had open is taken on this node"),
    (re.compile(r"Connected TCP socket"), "the job has established TCP connections: pass --tcp-established to "
                                          "keep them (a restore then needs --tcp-established too)"),
    (re.compile(r"conflicting lock"), "another process holds a lock the job held on one of its files (on a move "
                                      "between nodes that share the file: the job's own stopped original)"),
    (re.compile(r"nested user namespace"), "the job runs in a user namespace of its own (nested): CRIU cannot "
                                           "checkpoint that on this node"),
    (re.compile(r"In-flight connection"), "a connection was still in a listener's accept queue: leave such "
                                          "connections out with --skip-in-flight (the default)"),
    (re.compile(r"Can't get proc fd|can't open proc"), "CRIU cannot use /proc here (mount namespace?)"),
    (re.compile(r"ptrace|Operation not permitted"), "CRIU lacks a privilege (CAP_SYS_PTRACE, "
                                                    "CAP_CHECKPOINT_RESTORE, CAP_SYS_RESOURCE)"),
)


def hint_for(line: str) -> str:
    """What the decisive error line means for the user ('' when we know no better than CRIU)."""
    return next((h for pat, h in _HINTS if pat.search(line)), "")
