"""The host pid a test workload prints on each line: the init of its memsnap job (one per restored copy),
shared by the workloads in tests/ and scripts/bench (tests/gpu keeps its own copy: that folder runs on a GPU
node by itself)."""

import os

_JOB_PID = ("", "")


def job_pid() -> str:
    """This job's host pid: the init of its own PID namespace when it runs under one (memsnap starts jobs
    under a small init, memsnap.jobinit), else this process. /proc is the host's, so pids are host pids.
    Looked up again only when our own host pid changed (a restore): an open /proc file caught by a
    checkpoint would name a pid that is gone at restore."""
    global _JOB_PID
    me = os.readlink("/proc/self")
    if _JOB_PID[0] != me:
        _JOB_PID = (me, _find_job_pid(me))
    return _JOB_PID[1]


def _find_job_pid(me: str) -> str:
    cur = me
    while True:
        try:
            with open(f"/proc/{cur}/status") as f:
                fields = dict(ln.split(":", 1) for ln in f.read().splitlines() if ":" in ln)
        except OSError:
            return me
        nspid = fields.get("NSpid", "").split()
        if len(nspid) > 1 and nspid[-1] == "1":
            return cur
        cur = fields.get("PPid", "0").strip()
        if len(nspid) <= 1 or cur in ("0", ""):
            return me
