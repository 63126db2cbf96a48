"""Catalog records as protobuf messages: for the servicers (api.py) and for the move code's calls to a
peer (a stored checkpoint named in RestoreReceived, the job a commit kept)."""

from __future__ import annotations

from typing import Any

from memsnap import containers
from memsnap.catalog import CheckpointRecord, JobRecord
from memsnap.phases import CHECKPOINT, RESTORE
from memsnap.retention import sizes
from memsnap.v1 import memsnap_pb2 as pb

STATE_TO_PB = {
    "dumping": pb.CHECKPOINT_STATE_DUMPING, "staged": pb.CHECKPOINT_STATE_STAGED,
    "draining": pb.CHECKPOINT_STATE_DRAINING, "durable": pb.CHECKPOINT_STATE_DURABLE,
    "failed": pb.CHECKPOINT_STATE_FAILED,
}


def _u32(x: int) -> int:
    """A value for a uint32 field (never one that makes a whole listing fail)."""
    return x if 0 <= x < 1 << 32 else (1 << 32) - 1


def _u64(x: int) -> int:
    return x if 0 <= x < 1 << 64 else 0


def _int(x: Any) -> int:
    """An int from a record's (possibly another node's) JSON, 0 for anything else."""
    try:
        return int(x or 0)
    except (TypeError, ValueError, OverflowError):
        return 0


def gpus_pb(entries: Any) -> list[pb.GpuInfo]:
    """The manifest's CUDA processes (memsnap.gpu.adapter.describe) as one GpuInfo per process and GPU it used."""
    out: list[pb.GpuInfo] = []
    for e in entries if isinstance(entries, list) else []:
        if not isinstance(e, dict):
            continue
        pid, driver = _int(e.get("pid")), str(e.get("driver_version") or "")
        used = [g for g in e.get("gpus") or [] if isinstance(g, dict)] if isinstance(e.get("gpus"), list) else []
        for g in used or [{"model": e.get("model"), "uuid": e.get("uuid"), "bytes": e.get("device_bytes")}]:
            out.append(pb.GpuInfo(model=str(g.get("model") or ""), uuid=str(g.get("uuid") or ""),
                                  driver_version=driver, device_bytes=_u64(_int(g.get("bytes"))), pid=pid))
    return out


def phases_pb(phases: Any, order: tuple[str, ...] = CHECKPOINT) -> list[pb.Phase]:
    """{phase: seconds} (memsnap.phases) as Phase messages, in the order they run (a manifest's JSON sorts keys)."""
    if not isinstance(phases, dict):
        return []
    out = []
    rank = {name: i for i, name in enumerate(order)}
    for name, secs in sorted(phases.items(), key=lambda kv: (rank.get(str(kv[0]), len(rank)), str(kv[0]))):
        try:
            ms = round(float(secs) * 1000)
        except (TypeError, ValueError, OverflowError):
            continue
        out.append(pb.Phase(name=str(name), ms=_u64(ms)))
    return out


def ckpt_pb(r: CheckpointRecord) -> pb.CheckpointInfo:
    """A catalog record as a proto message."""
    m = r.meta
    logical, stored, new = sizes(r)
    gpus = gpus_pb(m.get("gpus"))
    device = min(sum(_int(e.get("device_bytes")) for e in m.get("gpus") or [] if isinstance(e, dict)), logical)
    return pb.CheckpointInfo(
        id=r.id, state=STATE_TO_PB.get(r.state, pb.CHECKPOINT_STATE_UNSPECIFIED), pid=r.pid, job=r.job,
        name=r.name, owner_uid=_u32(r.owner_uid), created_unix_ms=r.created_ms, size_bytes=_u64(r.size_bytes),
        frozen_ms=_u64(r.frozen_ms), dump_ms=_u64(r.dump_ms), in_tier=r.in_tier, in_store=r.in_store,
        drained_bytes=_u64(r.drained_bytes), stored_bytes=_u64(stored), last_error=r.last_error,
        drain_attempts=_u32(r.drain_attempts), argv=[str(a) for a in m.get("argv", []) or []],
        hostname=str(m.get("host", "")), criu_version=str(m.get("criu_version", "")), gpus=gpus,
        durable_unix_ms=r.durable_ms,
        parked_reason=str((m.get("parked") or {}).get("reason", "")),
        parked_unix_ms=_u64(int((m.get("parked") or {}).get("at_ms", 0))),
        logical_bytes=_u64(logical), new_bytes=_u64(new), host_bytes=_u64(logical - device),
        device_bytes=_u64(device), phases=phases_pb(m.get("phases")),
        restore_phases=phases_pb(m.get("restore_phases"), RESTORE), container=containers.of_checkpoint(m),
    )


def job_pb(j: JobRecord, running: bool, g: Any = None) -> pb.Job:
    """A job record as a proto message (g: what the memory guard knows of it, if anything)."""
    out = pb.Job(id=j.id, name=j.name, pid=j.pid, argv=j.argv, owner_uid=_u32(j.owner_uid), log_path=j.log_path,
                 started_unix_ms=j.started_ms, running=running, restored_from=j.restored_from,
                 moved_from=j.moved_from)
    if g is not None:
        out.guard_state, out.parked_reason, out.parked_unix_ms = g.state, g.reason, g.parked_ms
        out.parked_checkpoint, out.memory_limit_bytes, out.priority = g.checkpoint, _u64(g.limit), g.priority
        out.resumed_as = g.resumed_as
    return out


__all__ = ["STATE_TO_PB", "ckpt_pb", "gpus_pb", "job_pb", "phases_pb"]
