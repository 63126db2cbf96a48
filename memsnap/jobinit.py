"""The tiny init every job runs under, as PID 1 of its PID namespace (like `docker run --init`, tini).

The kernel drops signals to a namespace's PID 1 that it has no handler for, so a job that is itself PID 1
ignores `kill PID` (SIGTERM) from the host. Instead PID 1 is a small bash loop that traps the usual
signals and passes each to its one child, the job's command; it reaps orphans, and exits with the
child's status once the child ends, which ends the namespace. CRIU dumps and restores it like any
other process of the tree (bash sits in wait(); the restored one waits on).
"""

from __future__ import annotations

from typing import Any

NAME = "memsnap-init"
FORWARDED = ("TERM", "INT", "HUP", "QUIT", "USR1", "USR2", "WINCH", "ALRM", "CONT")

# set -m: the child gets its own process group and default SIGINT/SIGQUIT (without it, bash starts
# background commands with those two ignored). The loop waits again after a trapped signal interrupts
# `wait`, and exits with the child's status once it is gone.
_SCRIPT = (
    "set -m; child=; "
    + " ".join(f"trap '[ -n \"$child\" ] && kill -{s} \"$child\" 2>/dev/null' {s};" for s in FORWARDED)
    + ' "$@" & child=$!; set +m; '
    + 'while :; do wait "$child"; rc=$?; kill -0 "$child" 2>/dev/null || exit "$rc"; done'
)


def wrap(argv: list[str]) -> list[str]:
    """argv run under the init: the init becomes PID 1 and argv its only child."""
    return ["/bin/bash", "-c", _SCRIPT, NAME, *argv]


def is_init(cmdline: list[str]) -> bool:
    """Whether a process's argv is our init's."""
    return len(cmdline) >= 4 and cmdline[1:4] == ["-c", _SCRIPT, NAME]


def signal_targets(pid: int) -> list[Any]:
    """Who gets a job's SIGTERM: the init alone (it passes it on); for a job started without it (older
    images), every process of the tree, children first, as PID 1 itself would ignore it."""
    import psutil

    try:
        root = psutil.Process(pid)
        if is_init(root.cmdline()):
            return [root]
        return [*reversed(root.children(recursive=True)), root]
    except psutil.Error:
        return []
