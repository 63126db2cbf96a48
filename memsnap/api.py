"""gRPC servicer: proto <-> engine translation and exception -> status code mapping. No logic here."""

from __future__ import annotations

import functools
import logging
import re
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from memsnap.catalog import DURABLE, FAILED, CheckpointRecord, JobRecord
from memsnap.engine import ROOT, Caller, Engine
from memsnap.errors import InvalidArgument, MemsnapError, Unauthenticated
from memsnap.remote import tcp_authenticated
from memsnap.v1 import memsnap_pb2 as pb
from memsnap.v1 import memsnap_pb2_grpc as pb_grpc

log = logging.getLogger("memsnap.api")

STATE_TO_PB = {
    "dumping": pb.CHECKPOINT_STATE_DUMPING, "staged": pb.CHECKPOINT_STATE_STAGED,
    "draining": pb.CHECKPOINT_STATE_DRAINING, "durable": pb.CHECKPOINT_STATE_DURABLE,
    "failed": pb.CHECKPOINT_STATE_FAILED,
}
# The relay binds its upstream socket to this abstract name, so grpc's peer string carries SO_PEERCRED.
PEER_RE = re.compile(r"^unix-abstract:memsnap-peer/(\d+)/(\d+)/(\d+)/")

F = TypeVar("F", bound=Callable[..., Any])


def caller_of(context: grpc.ServicerContext) -> Caller:
    """The caller's identity: peer credentials via the relay, or an authenticated TCP peer (root)."""
    peer = context.peer()
    m = PEER_RE.match(peer)
    if m:
        return Caller(uid=int(m.group(1)), gid=int(m.group(2)), pid=int(m.group(3)))
    if tcp_authenticated():
        # Set only by memsnap.remote's interceptor, for this call, after checking the token or client
        # certificate; no request header can set it.
        return ROOT
    raise Unauthenticated("caller identity unknown; connect through the daemon's Unix socket")


def translate(fn: F) -> F:
    """Maps engine errors to gRPC status codes with a one-line message."""

    @functools.wraps(fn)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(self, request, context)
        except MemsnapError as exc:
            log.info("%s refused: %s", fn.__name__, exc, extra={"code": exc.code, "peer": context.peer()})
            context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        except Exception as exc:  # keep the daemon up and tell the caller something useful
            if _aborted(context):
                raise  # context.abort() inside fn already set the status
            log.exception("internal error in %s", fn.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"internal error: {exc}; see the memsnapd log")

    return wrapper  # type: ignore[return-value]


def _aborted(context: grpc.ServicerContext) -> bool:
    code = context.code() if hasattr(context, "code") else None
    return code is not None and code != grpc.StatusCode.OK


def ckpt_pb(r: CheckpointRecord) -> pb.CheckpointInfo:
    """A catalog record as a proto message."""
    m = r.meta
    gpus = [pb.GpuInfo(model=str(g.get("model", "")), uuid=str(g.get("uuid", "")),
                       driver_version=str(g.get("driver_version", "")),
                       device_bytes=int(g.get("device_bytes", 0)), pid=int(g.get("pid", 0)))
            for g in m.get("gpus", []) or []]
    return pb.CheckpointInfo(
        id=r.id, state=STATE_TO_PB.get(r.state, pb.CHECKPOINT_STATE_UNSPECIFIED), pid=r.pid, job=r.job,
        name=r.name, owner_uid=r.owner_uid, created_unix_ms=r.created_ms, size_bytes=r.size_bytes,
        frozen_ms=r.frozen_ms, dump_ms=r.dump_ms, in_tier=r.in_tier, in_store=r.in_store,
        drained_bytes=r.drained_bytes, stored_bytes=r.stored_bytes, last_error=r.last_error,
        drain_attempts=r.drain_attempts, argv=m.get("argv", []), hostname=m.get("host", ""),
        criu_version=m.get("criu_version", ""), gpus=gpus, durable_unix_ms=r.durable_ms,
    )


def job_pb(j: JobRecord, running: bool) -> pb.Job:
    """A job record as a proto message."""
    return pb.Job(id=j.id, name=j.name, pid=j.pid, argv=j.argv, owner_uid=j.owner_uid, log_path=j.log_path,
                  started_unix_ms=j.started_ms, running=running, restored_from=j.restored_from)


class MemsnapServicer(pb_grpc.MemsnapServicer):
    """The memsnap.v1.Memsnap service over an Engine."""

    def __init__(self, engine: Engine, status_extra: Callable[[], dict[str, Any]] | None = None,
                 migrator: Any = None) -> None:
        self.engine = engine
        self.status_extra = status_extra or (lambda: {})
        self.migrator = migrator

    @translate
    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        caller_of(context)
        s = self.engine.status()
        s.update(self.status_extra())
        return pb.StatusResponse(**{k: v for k, v in s.items() if k in pb.StatusResponse.DESCRIPTOR.fields_by_name})

    @translate
    def RunJob(self, request: pb.RunJobRequest, context: grpc.ServicerContext) -> pb.RunJobResponse:
        job = self.engine.run_job(caller_of(context), list(request.argv), request.name, request.cwd,
                                  dict(request.env))
        return pb.RunJobResponse(job=job_pb(job, True))

    @translate
    def ListJobs(self, request: pb.ListJobsRequest, context: grpc.ServicerContext) -> pb.ListJobsResponse:
        return pb.ListJobsResponse(jobs=[job_pb(j, r) for j, r in self.engine.list_jobs(caller_of(context))])

    @translate
    def Checkpoint(self, request: pb.CheckpointRequest, context: grpc.ServicerContext) -> pb.CheckpointResponse:
        caller = caller_of(context)
        rec = self.engine.checkpoint(caller, request.target, stop=request.stop,
                                     tcp_established=request.tcp_established, name=request.name)
        if request.wait == pb.WAIT_FOR_DURABLE:
            rec = self._wait_durable(caller, rec.id, context)
        return pb.CheckpointResponse(checkpoint=ckpt_pb(rec))

    def _wait_durable(self, caller: Caller, ckpt_id: str, context: grpc.ServicerContext) -> CheckpointRecord:
        if self.engine.drain is None:
            raise InvalidArgument("this daemon has no store configured, so nothing becomes durable")
        while context.is_active():
            rec = self.engine.get(caller, ckpt_id)
            if rec.state in (DURABLE, FAILED):
                return rec
            time.sleep(0.1)
        return self.engine.get(caller, ckpt_id)

    @translate
    def Restore(self, request: pb.RestoreRequest, context: grpc.ServicerContext) -> pb.RestoreResponse:
        res = self.engine.restore_own_log(caller_of(context), request.checkpoint_id, lazy=request.lazy,
                                  gpu_map=dict(request.gpu_map) or None,
                                  tcp_established=request.tcp_established)
        return pb.RestoreResponse(pid=res.pid, job=job_pb(res.job, True), restore_ms=int(res.restore_ms),
                                  verify_ms=int(res.verify_ms), fetch_ms=int(res.fetch_ms),
                                  from_store=res.from_store)

    @translate
    def ListCheckpoints(self, request: pb.ListCheckpointsRequest,
                        context: grpc.ServicerContext) -> pb.ListCheckpointsResponse:
        recs = self.engine.list_checkpoints(caller_of(context), request.job)
        return pb.ListCheckpointsResponse(checkpoints=[ckpt_pb(r) for r in recs])

    @translate
    def GetCheckpoint(self, request: pb.GetCheckpointRequest,
                      context: grpc.ServicerContext) -> pb.GetCheckpointResponse:
        return pb.GetCheckpointResponse(checkpoint=ckpt_pb(self.engine.get(caller_of(context), request.id)))

    @translate
    def DeleteCheckpoint(self, request: pb.DeleteCheckpointRequest,
                         context: grpc.ServicerContext) -> pb.DeleteCheckpointResponse:
        caller = caller_of(context)
        self.engine.delete(caller, request.id)
        log.info("checkpoint deleted", extra={"checkpoint_id": request.id, "uid": caller.uid})
        return pb.DeleteCheckpointResponse()

    @translate
    def EvictCheckpoint(self, request: pb.EvictCheckpointRequest,
                        context: grpc.ServicerContext) -> pb.EvictCheckpointResponse:
        caller = caller_of(context)
        rec = self.engine.evict(caller, request.id)
        log.info("tier copy evicted", extra={"checkpoint_id": request.id, "uid": caller.uid})
        return pb.EvictCheckpointResponse(checkpoint=ckpt_pb(rec))

    @translate
    def WatchCheckpoint(self, request: pb.WatchCheckpointRequest,
                        context: grpc.ServicerContext) -> Iterator[pb.CheckpointInfo]:
        caller = caller_of(context)
        rec = self.engine.get(caller, request.id)
        return self._watch(caller, rec, context)

    def _watch(self, caller: Caller, rec: CheckpointRecord,
               context: grpc.ServicerContext) -> Iterator[pb.CheckpointInfo]:
        last: tuple[Any, ...] = ()
        while context.is_active():
            key = (rec.state, rec.drained_bytes, rec.stored_bytes, rec.last_error, rec.in_tier)
            if key != last:
                yield ckpt_pb(rec)
                last = key
            if rec.state in (DURABLE, FAILED):
                return
            time.sleep(0.1)
            found = self.engine.catalog.get_checkpoint(rec.id)
            if found is None:
                return
            rec = found

    # Migration RPCs are served by memsnap.migrate when that module is wired in.
    @translate
    def Migrate(self, request: pb.MigrateRequest, context: grpc.ServicerContext) -> pb.MigrateResponse:
        if self.migrator is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "migration is not available in this daemon")
        resp: pb.MigrateResponse = self.migrator.migrate(caller_of(context), request, context)
        return resp

    @translate
    def ReceiveImage(self, request_iterator: Iterator[pb.ImageChunk],
                     context: grpc.ServicerContext) -> pb.ReceiveImageResponse:
        if self.migrator is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "migration is not available in this daemon")
        got: pb.ReceiveImageResponse = self.migrator.receive(caller_of(context), request_iterator, context)
        return got

    @translate
    def PageTunnel(self, request_iterator: Iterator[pb.TunnelChunk],
                   context: grpc.ServicerContext) -> Iterator[pb.TunnelChunk]:
        if self.migrator is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "migration is not available in this daemon")
        out: Iterator[pb.TunnelChunk] = self.migrator.tunnels.serve(caller_of(context), request_iterator, context)
        return out

    @translate
    def RestoreReceived(self, request: pb.RestoreReceivedRequest,
                        context: grpc.ServicerContext) -> pb.RestoreResponse:
        if self.migrator is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "migration is not available in this daemon")
        res: pb.RestoreResponse = self.migrator.restore_received(caller_of(context), request, context)
        return res

    @translate
    def StopJob(self, request: pb.StopJobRequest, context: grpc.ServicerContext) -> pb.StopJobResponse:
        job, killed, ms = self.engine.stop_job(caller_of(context), request.job, timeout_s=request.timeout_s or 10.0,
                                               kill=request.kill)
        return pb.StopJobResponse(job=job_pb(job, False), killed=killed, stop_ms=int(ms))

    @translate
    def DeleteJob(self, request: pb.DeleteJobRequest, context: grpc.ServicerContext) -> pb.DeleteJobResponse:
        job = self.engine.delete_job(caller_of(context), request.job, force=request.force)
        return pb.DeleteJobResponse(job=job_pb(job, False))

    @translate
    def Prune(self, request: pb.PruneRequest, context: grpc.ServicerContext) -> pb.PruneResponse:
        ended, failed, freed = self.engine.prune(caller_of(context), dry_run=request.dry_run)
        return pb.PruneResponse(jobs=[job_pb(j, False) for j in ended], checkpoints=[ckpt_pb(r) for r in failed],
                                log_bytes=freed)

    @translate
    def JobLogs(self, request: pb.JobLogsRequest, context: grpc.ServicerContext) -> Iterator[pb.LogChunk]:
        chunks = self.engine.job_log(caller_of(context), request.job, follow=request.follow,
                                     tail_bytes=request.tail_bytes, active=context.is_active)
        job, _ = next(chunks)  # NotFound and PermissionDenied surface here, before the stream starts
        return self._log_stream(job, chunks)

    @staticmethod
    def _log_stream(job: JobRecord, chunks: Iterator[tuple[JobRecord, bytes]]) -> Iterator[pb.LogChunk]:
        yield pb.LogChunk(job=job.id, path=job.log_path)
        for _, data in chunks:
            yield pb.LogChunk(data=data)
