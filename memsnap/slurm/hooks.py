"""Node-side Slurm hooks. The epilog runs (as root, on every node of the job) after each run of a job:

- it waits (bounded) for a checkpoint of the job that memsnapd is still dumping;
- a workload of the job that still runs is an orphan (its launcher is gone): on a requeue it is
  checkpointed with stop first (a late rescue, when the launcher was killed too early), otherwise,
  or if that fails, it is killed; it must not run on beside the next run of the job;
- when the job is really over (completed, failed, cancelled, timed out), the job's checkpoints are
  deleted from the tier, the store and the catalog; on a requeue they are kept for the next run.

When in doubt (slurmctld does not answer) it keeps the checkpoints: a leak, never a loss.
The hook never fails the node: errors are logged and it exits 0 (see scripts/slurm/epilog.sh).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from memsnap import proc
from memsnap.client import ClientError, MemsnapClient
from memsnap.slurm import env as slurm_env
from memsnap.v1 import memsnap_pb2 as pb

DUMPING = pb.CHECKPOINT_STATE_DUMPING


@dataclass
class EpilogResult:
    """What the epilog did, for its log line and for tests."""

    job_id: str
    key: str
    fate: str = "untouched"
    rescued: list[str] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line for the hook log."""
        parts = [f"job {self.job_id} ({self.key}): {self.fate}"]
        if self.rescued:
            parts.append(f"rescued {','.join(self.rescued)}")
        if self.killed:
            parts.append(f"killed pids {','.join(map(str, self.killed))}")
        if self.deleted:
            parts.append(f"deleted {len(self.deleted)} checkpoint(s)")
        if self.errors:
            parts.append("errors: " + "; ".join(self.errors))
        return ", ".join(parts)


def epilog(client: MemsnapClient, job_id: str, key: str = "", keep: bool = False, dump_wait: float = 120.0,
           rescue_timeout: float = 120.0,
           fate_of: Callable[[str], slurm_env.Fate] | None = None) -> EpilogResult:
    """Cleans up after one run of Slurm job job_id (see the module doc)."""
    key = key or slurm_env.key_for(job_id)
    res = EpilogResult(job_id=job_id, key=key)
    fate_of = fate_of or (lambda j: slurm_env.job_fate(j))
    running = [j for j in client.jobs() if j.name == key and j.running]
    ckpts = [c for c in client.list() if c.name == key]
    if not running and not ckpts:
        return res  # not a memsnap job: the common case, and cheap.
    res.fate = fate_of(job_id)

    deadline = time.monotonic() + dump_wait
    while any(c.state == DUMPING for c in ckpts) and time.monotonic() < deadline:
        time.sleep(0.5)
        ckpts = [c for c in client.list() if c.name == key]
    if any(c.state == DUMPING for c in ckpts):
        res.errors.append("a checkpoint is still being dumped; left alone")
        return res
    running = [j for j in client.jobs() if j.name == key and j.running]

    for j in running:
        if res.fate != "final":
            try:
                ck = client.checkpoint(j.id, stop=True, name=key, timeout=rescue_timeout)
                res.rescued.append(ck.id)
                continue
            except ClientError as exc:
                res.errors.append(f"rescue checkpoint of {j.id} failed: {exc.message}")
        if _kill(int(j.pid)):
            res.killed.append(int(j.pid))

    if res.fate == "final" and not keep:
        for c in client.list():
            if c.name != key or c.state == DUMPING:
                continue
            try:
                client.delete(c.id)
                res.deleted.append(c.id)
            except ClientError as exc:
                res.errors.append(f"delete {c.id}: {exc.message}")
    return res


def _kill(pid: int) -> bool:
    try:
        if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return False
    except psutil.Error:
        return False
    proc.kill_tree(pid)
    return True

