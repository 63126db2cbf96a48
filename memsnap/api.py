"""gRPC servicer: proto <-> engine translation and exception -> status code mapping. No logic here."""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import grpc

from memsnap import progress
from memsnap import validate as v
from memsnap.auth import tcp_authenticated
from memsnap.catalog import JobRecord
from memsnap.convert import ckpt_pb, job_pb, phases_pb
from memsnap.engine import ROOT, Caller, DumpExtras, Engine
from memsnap.errors import FailedPrecondition, InvalidArgument, MemsnapError, PermissionDenied, Unauthenticated
from memsnap.gc import Collector
from memsnap.guard.policy import CRITICAL
from memsnap.guard.service import Guard, GuardedJob
from memsnap.move import Mover
from memsnap.move.plan import MoveRequest, MoveResult
from memsnap.phases import RESTORE
from memsnap.quota import Quotas
from memsnap.resolve import note_for_target
from memsnap.retention import Policy, not_ours, series_of, series_of_job
from memsnap.v1 import memsnap_pb2 as pb
from memsnap.v1 import memsnap_pb2_grpc as pb_grpc
from memsnap.v1 import peer_pb2, peer_pb2_grpc

log = logging.getLogger("memsnap.api")

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
        # Set only by memsnap.auth's interceptor, for this call, after checking the token or client
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
            log.info("%s refused: %s", fn.__name__, _one_line(str(exc)),
                     extra={"code": exc.code, "peer": context.peer()})
            context.abort(getattr(grpc.StatusCode, exc.code), _one_line(str(exc)))
        except Exception as exc:  # keep the daemon up and tell the caller something useful
            if _aborted(context):
                raise  # context.abort() inside fn already set the status
            if isinstance(exc, grpc.RpcError) and not context.is_active():
                # (a client stream's iterator raises once its caller cancelled or went away: nobody to answer)
                log.info("%s ended: the caller went away", fn.__name__, extra={"peer": context.peer()})
                return None
            log.exception("internal error in %s", fn.__name__)
            context.abort(grpc.StatusCode.INTERNAL,
                          f"internal error: {str(exc)[:v.CLIP]}; see the memsnapd log")

    return wrapper  # type: ignore[return-value]


# gRPC metadata (where the message travels) is limited to 8-16 KiB; messages clip caller input themselves.
_MAX_MESSAGE = 1024


def _one_line(msg: str) -> str:
    msg = " ".join(msg.split("\n"))
    return msg if len(msg) <= _MAX_MESSAGE else msg[:_MAX_MESSAGE] + "..."


def _aborted(context: grpc.ServicerContext) -> bool:
    code = context.code() if hasattr(context, "code") else None
    return code is not None and code != grpc.StatusCode.OK




class MemsnapServicer(pb_grpc.MemsnapServicer):
    """The memsnap.v1.Memsnap service over an Engine."""

    def __init__(self, engine: Engine, status_extra: Callable[[], dict[str, Any]] | None = None,
                 migrator: Mover | None = None, quota: Quotas | None = None, gc: Collector | None = None,
                 guard: Guard | None = None) -> None:
        self.engine = engine
        self.status_extra = status_extra or (lambda: {})
        self.migrator = migrator  # moves (memsnap.move): None = this daemon moves nothing
        self.guard = guard  # the memory guard (memsnap.guard): None = none on this daemon
        self.quota = quota  # [quota] (memsnap.quota): None = no limits
        self.gc = gc  # retention and the chunk sweep (memsnap.gc): None = this daemon runs none

    def _admit(self, admit: Callable[[Quotas], AbstractContextManager[None]]) -> AbstractContextManager[None]:
        """A quota admission (memsnap.quota) around a job, checkpoint or restore; nothing without quotas."""
        return nullcontext() if self.quota is None else admit(self.quota)

    @translate
    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        caller = caller_of(context)
        s = self.engine.status(caller)
        extra = self.status_extra()
        if not caller.is_root:  # the drain queue and moves in doubt are daemon-wide: root's to see
            extra = {k: v for k, v in extra.items() if k in ("store", "store_id")}
        s.update(extra)
        resp = pb.StatusResponse(**{k: v for k, v in s.items() if k in pb.StatusResponse.DESCRIPTOR.fields_by_name})
        op = progress.get(_op_id(request), caller.uid, caller.is_root) if request.op_id else None
        if op is not None:
            resp.progress.CopyFrom(pb.Progress(op_id=op.op_id, kind=op.kind, phase=op.phase, done_bytes=op.done_bytes(),
                                               total_bytes=op.total_bytes, started_unix_ms=op.started_unix_ms))
        for uid, used, limits in self.quota.report(caller) if self.quota is not None else ():
            resp.usage.append(pb.QuotaUsage(uid=uid, **dataclasses.asdict(used),
                                            **{f"{r}_limit": lim.value for r, lim in limits.items()}))
        return resp

    @translate
    def RunJob(self, request: pb.RunJobRequest, context: grpc.ServicerContext) -> pb.RunJobResponse:
        caller = caller_of(context)
        argv, env = v.argv(request.argv), v.env(request.env)
        v.exec_size(argv, env)
        # (unset: the node decides)
        spaces = {k: getattr(request, k) if request.HasField(k) else None for k in ("own_proc", "private_tmp")}
        keep = _keep_rules(request)
        with self._admit(lambda q: q.admit_job(caller)):
            if request.memory_limit_bytes or request.priority or request.critical or request.on_limit:
                resp = self._run_guarded(caller, request, argv, env, spaces)
            else:
                job = self.engine.run_job(caller, argv, v.name("name", request.name), v.cwd(request.cwd), env,
                                          own_proc=spaces["own_proc"], private_tmp=spaces["private_tmp"])
                resp = pb.RunJobResponse(job=job_pb(job, True))
        if keep is not None:
            self._gc().set_policy(series_of_job(resp.job.owner_uid, resp.job.name, resp.job.id), *keep)
        return resp

    @translate
    def ListJobs(self, request: pb.ListJobsRequest, context: grpc.ServicerContext) -> pb.ListJobsResponse:
        return pb.ListJobsResponse(jobs=[job_pb(j, r, self._guarded(j.id))
                                         for j, r in self.engine.list_jobs(caller_of(context))])

    @translate
    def Checkpoint(self, request: pb.CheckpointRequest, context: grpc.ServicerContext) -> pb.CheckpointResponse:
        caller = caller_of(context)
        v.key("target", request.target)
        v.name("name", request.name)
        v.enum("wait", request.wait, pb.WaitFor.values())
        keep = _keep_rules(request)
        strict = DumpExtras(dump_opts={"skip_in_flight": False}) if request.fail_on_in_flight else None
        with self._admit(lambda q: q.admit_checkpoint(caller, request.target)):
            rec = self.engine.checkpoint(caller, request.target, stop=request.stop,
                                         tcp_established=request.tcp_established, name=request.name, extras=strict)
        if keep is not None:
            self._gc().set_policy(series_of(rec), *keep)
        if request.wait == pb.WAIT_FOR_DURABLE:
            rec = self.engine.wait_settled(caller, rec.id, context.is_active)
        return pb.CheckpointResponse(checkpoint=ckpt_pb(rec))

    @translate
    def Restore(self, request: pb.RestoreRequest, context: grpc.ServicerContext) -> pb.RestoreResponse:
        caller = caller_of(context)
        v.key("checkpoint_id", request.checkpoint_id)
        with progress.begin(_op_id(request), "restore", caller.uid), \
                self._admit(lambda q: q.admit_restore(caller, request.checkpoint_id, request.lazy)):
            res = self.engine.restore_own_log(caller, request.checkpoint_id, lazy=request.lazy,
                                              gpu_map=v.gpu_map(request.gpu_map) or None,
                                              tcp_established=request.tcp_established,
                                              into=v.container("into", request.into, allow_empty=True))
        return pb.RestoreResponse(pid=res.pid, job=job_pb(res.job, True), restore_ms=int(res.restore_ms),
                                  verify_ms=int(res.verify_ms), fetch_ms=int(res.fetch_ms),
                                  from_store=res.from_store, phases=phases_pb(res.phases, RESTORE))

    @translate
    def ListCheckpoints(self, request: pb.ListCheckpointsRequest,
                        context: grpc.ServicerContext) -> pb.ListCheckpointsResponse:
        caller = caller_of(context)
        recs = self.engine.list_checkpoints(caller, v.key("job", request.job, allow_empty=True))
        return pb.ListCheckpointsResponse(checkpoints=[ckpt_pb(r) for r in recs])

    @translate
    def GetCheckpoint(self, request: pb.GetCheckpointRequest,
                      context: grpc.ServicerContext) -> pb.GetCheckpointResponse:
        caller = caller_of(context)
        return pb.GetCheckpointResponse(checkpoint=ckpt_pb(self.engine.get(caller, v.ckpt_id("id", request.id))))

    @translate
    def DeleteCheckpoint(self, request: pb.DeleteCheckpointRequest,
                         context: grpc.ServicerContext) -> pb.DeleteCheckpointResponse:
        caller = caller_of(context)
        ckpt = v.ckpt_id("id", request.id)
        theirs = not_ours(self.engine.get(caller, ckpt), self.engine.node)  # (the engine deletes it then)
        self.engine.delete(caller, ckpt)
        log.info("checkpoint deleted", extra={"checkpoint_id": ckpt, "uid": caller.uid})
        return pb.DeleteCheckpointResponse(note=f"forgot {ckpt} on this node; its stored copy stays: {theirs}"
                                           if theirs else "")

    @translate
    def EvictCheckpoint(self, request: pb.EvictCheckpointRequest,
                        context: grpc.ServicerContext) -> pb.EvictCheckpointResponse:
        caller = caller_of(context)
        ckpt = v.ckpt_id("id", request.id)
        rec = self.engine.evict(caller, ckpt)
        log.info("tier copy evicted", extra={"checkpoint_id": ckpt, "uid": caller.uid})
        return pb.EvictCheckpointResponse(checkpoint=ckpt_pb(rec))

    @translate
    def WatchCheckpoint(self, request: pb.WatchCheckpointRequest,
                        context: grpc.ServicerContext) -> Iterator[pb.CheckpointInfo]:
        caller = caller_of(context)
        return (ckpt_pb(r) for r in self.engine.watch(caller, v.ckpt_id("id", request.id), context.is_active))

    # Move RPCs are served by memsnap.move (Mover).
    @translate
    def Migrate(self, request: pb.MigrateRequest, context: grpc.ServicerContext) -> pb.MigrateResponse:
        caller = caller_of(context)
        v.key("target", request.target)
        v.addr("to", request.to)
        v.addr("move_ip", request.move_ip)
        v.ifname("move_ip_dev_source", request.move_ip_dev_source)
        v.ifname("move_ip_dev_target", request.move_ip_dev_target)
        v.token("to_token", request.to_token)
        v.container("into", request.into, allow_empty=True)
        req = MoveRequest(**{f.name: getattr(request, f.name) for f in dataclasses.fields(MoveRequest)})
        note = note_for_target(self.engine.catalog.jobs(), request.target,  # (said only once the move is done)
                               lambda j: caller.is_root or j.owner_uid == caller.uid, "moved")
        if self.migrator is None:
            raise FailedPrecondition("this memsnapd moves no jobs (it was started without its mover)")
        with progress.begin(_op_id(request), "migrate", caller.uid):
            res: MoveResult = self.migrator.migrate(caller, req)
        return pb.MigrateResponse(target_pid=res.target_pid, checkpoint_id=res.checkpoint_id,
                                  phases=[pb.Phase(name=n, ms=int(ms)) for n, ms in res.phases],
                                  downtime_ms=res.downtime_ms, bytes_sent=res.bytes_sent, target_job=res.target_job,
                                  note=note)

    @translate
    def StopJob(self, request: pb.StopJobRequest, context: grpc.ServicerContext) -> pb.StopJobResponse:
        job, killed, ms = self.engine.stop_job(caller_of(context), v.key("job", request.job),
                                               timeout_s=_timeout(request.timeout_s),
                                               kill=request.kill)
        return pb.StopJobResponse(job=job_pb(job, False), killed=killed, stop_ms=int(ms))

    @translate
    def DeleteJob(self, request: pb.DeleteJobRequest, context: grpc.ServicerContext) -> pb.DeleteJobResponse:
        job = self.engine.delete_job(caller_of(context), v.key("job", request.job), force=request.force)
        return pb.DeleteJobResponse(job=job_pb(job, False))

    @translate
    def Prune(self, request: pb.PruneRequest, context: grpc.ServicerContext) -> pb.PruneResponse:
        ended, failed, freed = self.engine.prune(caller_of(context), dry_run=request.dry_run)
        return pb.PruneResponse(jobs=[job_pb(j, False) for j in ended], checkpoints=[ckpt_pb(r) for r in failed],
                                log_bytes=freed)

    @translate
    def Gc(self, request: pb.GcRequest, context: grpc.ServicerContext) -> pb.GcResponse:
        rep = self._gc().run(caller_of(context), dry_run=request.dry_run)
        return pb.GcResponse(dry_run=rep.dry_run, deleted=[ckpt_pb(r) for r in rep.deleted],
                             kept=[pb.GcKept(id=k, reason=why) for k, why in sorted(rep.kept.items())],
                             checkpoint_bytes=rep.checkpoint_bytes, swept=rep.swept, sweep_note=rep.sweep_note,
                             chunks_swept=rep.sweep.deleted, chunk_bytes_freed=rep.sweep.bytes_freed,
                             chunks_in_grace=rep.sweep.kept_in_grace, duration_ms=rep.duration_ms,
                             forgotten=[pb.GcKept(id=k, reason=why) for k, why in sorted(rep.forgotten.items())])

    def _gc(self) -> Collector:
        if self.gc is None:
            raise FailedPrecondition("this daemon runs no garbage collector")
        return self.gc

    @translate
    def JobLogs(self, request: pb.JobLogsRequest, context: grpc.ServicerContext) -> Iterator[pb.LogChunk]:
        chunks = self.engine.job_log(caller_of(context), v.key("job", request.job), follow=request.follow,
                                     tail_bytes=v.size("tail_bytes", request.tail_bytes), active=context.is_active)
        job, _ = next(chunks)  # NotFound and PermissionDenied surface here, before the stream starts
        return self._log_stream(job, chunks)

    @staticmethod
    def _log_stream(job: JobRecord, chunks: Iterator[tuple[JobRecord, bytes]]) -> Iterator[pb.LogChunk]:
        yield pb.LogChunk(job=job.id, path=job.log_path)
        for _, data in chunks:
            yield pb.LogChunk(data=data)

    # -- memory guard (memsnap.guard) ------------------------------------------------------
    def _run_guarded(self, caller: Caller, request: pb.RunJobRequest, argv: list[str], env: dict[str, str],
                     spaces: dict[str, bool | None]) -> pb.RunJobResponse:
        """RunJob with --memory-limit/--priority/--on-limit: the job starts inside its own memory cgroup."""
        guard = self._guard()
        limit = request.memory_limit_bytes
        if limit and not MIN_LIMIT <= limit <= v.MAX_BYTES:
            raise InvalidArgument(f"memory_limit_bytes {limit} is out of range: give at least 32M")
        if not -1000 <= request.priority <= 1000:
            raise InvalidArgument(f"priority {request.priority} is out of range: use -1000..1000, or critical")
        if request.on_limit not in ("", "park", "kill"):
            raise InvalidArgument(f"on_limit {v.clip(request.on_limit)} is not park or kill")
        if request.critical and not caller.is_root:
            raise PermissionDenied("only root may mark a job critical (never parked under node pressure)")
        priority = CRITICAL if request.critical else request.priority
        cgroup, procs = guard.prepare(limit) if limit else ("", "")
        try:
            job = self.engine.run_job(caller, argv, v.name("name", request.name), v.cwd(request.cwd), env,
                                      cgroup_procs=procs, **spaces)
        except BaseException:
            guard.forget_cgroup(cgroup)
            raise
        g = guard.adopt(job.id, caller.uid, limit, priority, request.on_limit or "park", cgroup)
        return pb.RunJobResponse(job=job_pb(job, True, g))

    def _guard(self) -> Guard:
        if self.guard is None or not self.guard.cfg.enabled:
            raise FailedPrecondition("the memory guard is off on this node ([guard] enabled = false)")
        return self.guard

    def _guarded(self, job_id: str) -> GuardedJob | None:
        """What the memory guard knows of a job (None: nothing, or no guard)."""
        return self.guard.get(job_id) if self.guard is not None else None

    @translate
    def ResumeJob(self, request: pb.ResumeJobRequest, context: grpc.ServicerContext) -> pb.RestoreResponse:
        caller = caller_of(context)
        v.key("job", request.job)
        limit = request.memory_limit_bytes
        if limit and not MIN_LIMIT <= limit <= v.MAX_BYTES:
            raise InvalidArgument(f"memory_limit_bytes {limit} is out of range: give at least 32M")
        with progress.begin(_op_id(request), "resume", caller.uid):
            res = self._guard().resume(request.job, caller=caller, new_limit=limit)
        return pb.RestoreResponse(pid=res.pid, job=job_pb(res.job, True, self._guarded(res.job.id)),
                                  restore_ms=int(res.restore_ms), verify_ms=int(res.verify_ms),
                                  fetch_ms=int(res.fetch_ms), from_store=res.from_store)


MIN_LIMIT = 32 << 20


def _keep_rules(request: Any) -> tuple[int | None, float | None] | None:
    """A RunJob's or Checkpoint's --keep-last/--keep-within (None: neither given), checked."""
    kl = request.keep_last if request.HasField("keep_last") else None
    kw = request.keep_within_s if request.HasField("keep_within_s") else None
    if kl is None and kw is None:
        return None
    try:
        Policy(kl, kw)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    return kl, kw


def _op_id(request: Any) -> str:
    """A request's op_id (memsnap.progress), refused unless it is a short plain token."""
    op_id: str = request.op_id
    if op_id and not progress.valid_op_id(op_id):
        raise InvalidArgument("op_id must be 1-64 letters, digits, '-' or '_'")
    return op_id


class PeerServicer(peer_pb2_grpc.PeerServicer):
    """The memsnap.v1.Peer service (daemon-to-daemon calls of a move) over the daemon's Mover; translation
    only (who may call it is auth.py's PEER_METHODS, plus the Mover's root check for local callers)."""

    def __init__(self, mover: Mover) -> None:
        self.mover = mover

    @translate
    def ReceiveImage(self, request_iterator: Iterator[pb.ImageChunk],
                     context: grpc.ServicerContext) -> pb.ReceiveImageResponse:
        got: pb.ReceiveImageResponse = self.mover.receive(caller_of(context), _checked_chunks(request_iterator),
                                                          context)
        return got

    @translate
    def PageTunnel(self, request_iterator: Iterator[pb.TunnelChunk],
                   context: grpc.ServicerContext) -> Iterator[pb.TunnelChunk]:
        out: Iterator[pb.TunnelChunk] = self.mover.tunnels.serve(caller_of(context), request_iterator, context)
        return out

    @translate
    def RestoreReceived(self, request: pb.RestoreReceivedRequest,
                        context: grpc.ServicerContext) -> pb.RestoreResponse:
        caller = caller_of(context)
        _check_restore_received(request)
        res: pb.RestoreResponse = self.mover.restore_received(caller, request, context)
        return res

    @translate
    def CommitMove(self, request: peer_pb2.CommitMoveRequest,
                   context: grpc.ServicerContext) -> peer_pb2.CommitMoveResponse:
        caller = caller_of(context)
        res: pb.RestoreResponse = self.mover.commit_move(caller, v.ckpt_id("checkpoint_id", request.checkpoint_id))
        return peer_pb2.CommitMoveResponse(job=res.job)


def _check_restore_received(request: pb.RestoreReceivedRequest) -> None:
    v.ckpt_id("checkpoint_id", request.checkpoint_id)
    v.key("lazy_tunnel", request.lazy_tunnel, allow_empty=True)
    v.addr("add_ip", request.add_ip)
    v.ifname("add_ip_dev", request.add_ip_dev)
    v.container("into", request.into, allow_empty=True)
    if request.HasField("from_store"):
        v.ckpt_id("from_store.id", request.from_store.id)


def _checked_chunks(chunks: Iterator[pb.ImageChunk]) -> Iterator[pb.ImageChunk]:
    """An image stream whose every chunk passes the edge checks (ids, names, offsets, sizes)."""
    first = True
    for c in chunks:
        if first or c.checkpoint_id:
            v.ckpt_id("checkpoint_id", c.checkpoint_id)
        first = False
        v.size("offset", c.offset)
        v.size("expected_bytes", c.expected_bytes)
        v.size("offset + data", c.offset + len(c.data))
        v._plain("file", c.file, v.MAX_PATH)
        yield c


def _timeout(seconds: float) -> float:
    """A stop timeout: 10 s when unset; a finite number of seconds up to a day."""
    if seconds != seconds or seconds < 0 or seconds > 86400:  # NaN, negative, absurd
        raise InvalidArgument(f"timeout_s must be between 0 and 86400 seconds, got {v.clip(repr(seconds))}")
    return seconds or 10.0
