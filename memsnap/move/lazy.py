"""Lazy (post-copy) moves: the job runs on the target before its memory has arrived.

    source                                         target
    preflight, then PageTunnel(tunnel, ckpt) ----> a socketpair waits for lazy-pages
    CRIU lazy dump, tree left stopped; its page
      server talks over a socketpair whose other
      end feeds the tunnel (no TCP port opens)
    post-dump: the small images (no pages)  -----> ReceiveImage: a "pages_remote" image
               RestoreReceived(lazy_tunnel) -----> supervised `criu lazy-pages --ps-socket`,
                                                   then a lazy restore: the job runs
    CRIU serves faults and pushes the rest  <----> through the tunnel
    CRIU returns once lazy-pages closed     <----- done{ok}: every page arrived
    ok: kill the stopped copy here                 drop the small image
    not ok: SIGCONT it here                        the supervisor killed the half-restored job

Until the target says every page arrived, the source keeps its frozen copy, so any failure (target
refuses or dies, the link drops, the source daemon dies) leaves the job running on the source. The
target's half-restored copy is killed by a supervisor shell around lazy-pages that outlives memsnapd:
once userfaultfd is gone, missing pages would read as zeros. What the job did on the target before a
failure (output, network traffic) is not undone: that is post-copy's price.

Page bytes travel inside the peers' authenticated gRPC channel (token or mutual TLS), like the images.
CRIU's page-server protocol has no checksums, so every tunnel message is sealed (see Seal): a keyed
blake3 tag over its sequence number and content. A flipped bit, a lost, reordered or replayed message,
or a forged one ends the move, and the job runs on at the source. The small images
and their signed manifest are checked as for any move.
"""

from __future__ import annotations

import json
import logging
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memsnap import background, failpoints, knobs, lifecycle, manifest, net, proc
from memsnap.auth import transfer_key
from memsnap.catalog import DUMPING, FAILED, CheckpointRecord, now_ms
from memsnap.client import ClientError
from memsnap.criu import CriuApi, CriuError, DumpOptions, NotifyHandlers, own_mount_ns, pipe_size_problem
from memsnap.engine import Caller
from memsnap.errors import (
    FailedPrecondition,
    InvalidArgument,
    MemsnapError,
)
from memsnap.move.peer import PeerClient
from memsnap.move.plan import (
    Commitments,
    Move,
    MoveHost,
    MoveRequest,
    MoveResult,
    Phases,
    mark_moved,
    move_error,
    restore_network,
    rollback,
    target_job,
)
from memsnap.move.stream import RESERVE_SLACK, ImageStreamer, StreamBroken
from memsnap.move.tunnel import VERDICT_S, SourceTunnel, ask_verdict, shutdown, watch_stall
from memsnap.v1 import memsnap_pb2 as pb

log = logging.getLogger("memsnap.move")


@dataclass
class _SourceState:
    """What the post-dump callback learned, for the code after CRIU returned."""

    t_freeze: float = 0.0
    t_post_dump: float = 0.0
    t_images: float = 0.0
    t_resumed: float = 0.0
    image_bytes: int = 0
    failed_step: str = ""
    failure: str = ""
    failure_code: str = "UNAVAILABLE"
    restored: pb.RestoreResponse | None = None
    restore_done: threading.Event = field(default_factory=threading.Event)


# -- the lazy dump (source) ------------------------------------------------------------------------
def lazy_dump(host: MoveHost, rec: CheckpointRecord, ps_socket: int,
              notify_for: Callable[[Path], NotifyHandlers],
              container: dict[str, Any] | None = None) -> CriuError | None:
    """Dumps rec.pid without its memory, whose pages CRIU then serves over ps_socket until the peer has
    them all; the tree is left stopped (end_held / resume_held decide). rec is journaled first, with
    hold set, so recovery resumes the tree if we die. notify_for(staging) answers CRIU's callbacks.
    container: a container's dump options (memsnap.containers.DumpPlan), for its workload.
    Returns CRIU's error, if any; raises (job untouched) when the pid is busy or the tier full."""
    try:
        pid_start = proc.start_time(rec.pid)
    except proc.ProcessNotFound:
        pid_start = 0.0
    rec.meta = {**rec.meta, "stop": False, "hold": True, "pid_start": pid_start}
    lifecycle.begin(host.catalog, rec)
    staging = host.tier.new_staging(rec.id)
    work = host.work_root / rec.id
    work.mkdir(parents=True, exist_ok=True, mode=0o700)
    opts = DumpOptions(**{"leave_running": False, "leave_stopped": True, "lazy_pages": True, "ps_socket": ps_socket,
                          "shell_job": not proc.is_session_leader(rec.pid),
                          "own_mntns": own_mount_ns(rec.pid) if container is None else False,
                          **host.extra_dump_opts(), **(container or {})})
    try:
        with host.exclusive(rec.pid):
            reservation = host.reserve(RESERVE_SLACK)
            try:
                host.criu.dump(rec.pid, staging, work, opts, notify=notify_for(staging))
            except CriuError as exc:
                return exc
            finally:
                reservation.release()
    except Exception as exc:
        end_lazy_dump(host, rec.id, error=str(exc))
        raise
    finally:
        host.tier.discard_staging(rec.id)  # what the move needed of it has been sent
    return None


def end_lazy_dump(host: MoveHost, ckpt_id: str, error: str = "") -> None:
    """A failed lazy dump stays in the catalog as FAILED, with its logs; a moved one goes."""
    host.tier.discard_staging(ckpt_id)
    if error:
        lifecycle.advance(host.catalog, ckpt_id, FAILED, last_error=error)
        return
    lifecycle.forget(host.catalog, ckpt_id)
    if not knobs.keep_logs():
        shutil.rmtree(host.work_root / ckpt_id, ignore_errors=True)


def move_lazily(engine: MoveHost, commits: Commitments, caller: Caller, req: MoveRequest,
                client: PeerClient, token: str, move: Move, phases: Phases) -> MoveResult:
    """The source side of `migrate --lazy` (preflight already done): foreground work until the verdict, so
    drains step aside while this node serves the pages (memsnap.background)."""
    with background.gate().foreground("lazy move"):
        return _move_lazily(engine, commits, caller, req, client, token, move, phases)


def _move_lazily(engine: MoveHost, commits: Commitments, caller: Caller, req: MoveRequest,
                 client: PeerClient, token: str, move: Move, phases: Phases) -> MoveResult:
    pid = move.pid
    job = engine.catalog.get_job(move.job_id) if move.job_id else None
    owner = proc.owner_uid(pid)
    ckpt_id = lifecycle.new_id()
    tunnel_id = secrets.token_hex(16)
    state = _SourceState()
    plan = move.container  # (a container's workload: its placeholder starts on the target)
    argv, own_ns = proc.cmdline(pid), proc.in_own_pidns(pid) or plan is not None
    name = plan.facts.name if plan is not None else job.name if job else ""
    rec = CheckpointRecord(id=ckpt_id, state=DUMPING, pid=pid, owner_uid=owner, created_ms=now_ms(),
                           job=job.id if job else "", name=name, meta={"lazy_move": req.to})
    move.ckpt_id = ckpt_id

    def restore_there() -> None:
        rreq = pb.RestoreReceivedRequest(checkpoint_id=ckpt_id, lazy=True, lazy_tunnel=tunnel_id,
                                         add_ip=str(move.moved_ip) if move.moved_ip else "",
                                         add_ip_dev=req.move_ip_dev_target, into=req.into)
        try:
            state.restored = client.restore_received(rreq, timeout=600)
            state.t_resumed = time.monotonic()
            log.info("%s resumed on %s as pid %d; its pages follow from here", move.job_id or move.pid, req.to,
                     state.restored.pid, extra={"checkpoint_id": ckpt_id})
            failpoints.hit("lazy-pages-flowing")
        except ClientError as exc:
            state.failed_step, state.failure_code = "restore on the target", exc.code.name
            state.failure = f"{exc.code.name}: {exc.message}"
        finally:
            state.restore_done.set()

    def post_dump(staging: Path, stats_ms: float) -> None:
        if move.moved_ip is not None:
            move.ip_removed_from = net.remove_address(move.moved_ip, req.move_ip_dev_source)
        files = manifest.describe_files(staging)
        man = engine.new_manifest(rec, argv, own_ns, job, files, dump_ms=stats_ms, pages_remote=True)
        if plan is not None:
            man.extra["container"] = plan.facts.to_dict()
        body = man.body()
        state.image_bytes = sum(int(f["size"]) for f in files.values())
        streamer = ImageStreamer(client, state.image_bytes, pipelined=False)
        streamer.start(staging)
        streamer.file_table()
        wire = manifest.sign(body, transfer_key(token)) if token else body
        try:
            streamer.finish(json.dumps(wire, sort_keys=True).encode(), timeout=120)
        except StreamBroken:
            streamer.abort()
            raise
        state.t_images = time.monotonic()
        # Not awaited: the restore faults on pages that CRIU serves only once this callback returned.
        threading.Thread(target=restore_there, name=f"lazy-restore-{ckpt_id}", daemon=True).start()
        tunnel.last_activity = time.monotonic()
        watch_stall(f"stall-{ckpt_id}", lambda: tunnel.last_activity,
                     lambda: criu_done.is_set() or tunnel.done.is_set(), tunnel.abort)

    tunnel = SourceTunnel(client, tunnel_id, ckpt_id, token)
    criu_done = threading.Event()
    t_dump = time.monotonic()

    def notify_for(staging: Path) -> NotifyHandlers:
        def frozen() -> None:
            state.t_freeze = time.monotonic()

        def dumped() -> bool:
            state.t_post_dump = time.monotonic()
            try:
                post_dump(staging, (state.t_post_dump - t_dump) * 1000)
            except Exception as exc:
                code = getattr(exc, "code", "UNAVAILABLE")
                state.failed_step, state.failure = "transfer", str(exc)
                state.failure_code = code if isinstance(code, str) else "UNAVAILABLE"
                shutdown(tunnel.criu_end)  # CRIU's page server starts anyway; let it end at once
                return False  # CRIU resumes the tree
            return True

        return NotifyHandlers(pre_dump=frozen, post_dump=dumped)

    try:
        dump_error = lazy_dump(engine, rec, tunnel.criu_end.fileno(), notify_for,
                               plan.dump_opts if plan is not None else None)
    except MemsnapError as exc:  # busy, or no room for even the small images: the job was not touched
        tunnel.close()
        raise move_error(exc.code, f"migration failed at dump: {exc}; the job runs on here") from exc
    finally:
        criu_done.set()
        tunnel.criu_end.close()
    t_criu_done = time.monotonic()
    state.restore_done.wait(VERDICT_S if state.t_images else 0)
    tunnel.done.wait(VERDICT_S)
    verdict = tunnel.verdict or ask_verdict(client, tunnel_id, token)
    tunnel.close()

    def give_back(step: str, why: str, code: str) -> None:
        end_lazy_dump(engine, ckpt_id, error=f"{step}: {why}")  # (keeps CRIU's logs)
        rollback(engine, move, step, why, code)

    if dump_error is not None:
        if state.failed_step:
            # Our post-dump callback refused: CRIU let the tree run on by itself.
            restore_network(move)
            engine.resume_held(pid, ckpt_id)
            end_lazy_dump(engine, ckpt_id, error=state.failure)
            raise move_error(state.failure_code, f"migration failed at {state.failed_step}: {state.failure}; "
                         "the job was resumed on this node")
        if not state.t_post_dump:
            restore_network(move)
            end_lazy_dump(engine, ckpt_id, error=dump_error.reason)
            raise FailedPrecondition(f"migration failed at dump: {dump_error.reason} (log: "
                                     f"{dump_error.log_path}); the job was not moved and runs on here")
        give_back("pages", f"CRIU's page server failed: {dump_error.reason} (log: {dump_error.log_path})",
                  "UNAVAILABLE")
    if state.failed_step:
        give_back(state.failed_step, state.failure, state.failure_code)
    if verdict is None or not verdict[0]:
        why = verdict[1] if verdict else (tunnel.error or "the target gave no verdict")
        give_back("pages", f"not every page reached the target ({why})", "UNAVAILABLE")
    assert state.restored is not None
    phases.mark("dump", state.t_post_dump)
    phases.mark("transfer", state.t_images)
    phases.mark("restore", state.t_resumed)
    phases.mark("pages", t_criu_done)
    target_pid, moved_job = int(state.restored.pid), state.restored.job.id
    found = target_job(client, ckpt_id)
    if found is None or found.id != moved_job:
        give_back("confirm", f"the restored job {moved_job} is not running on the target", "FAILED_PRECONDITION")
    try:
        commits.commit_on(client, move, ckpt_id, req.to)
    except MemsnapError:
        end_lazy_dump(engine, ckpt_id, error="the target could not be told to keep it")
        raise
    phases.mark("confirm")
    # The target has every page, runs the job and keeps it: journal that, then let the frozen copy go.
    mark_moved(engine.catalog, ckpt_id, req.to, moved_job)
    engine.end_held(pid, move.job_id, ckpt_id)
    end_lazy_dump(engine, ckpt_id)
    phases.mark("cleanup")
    resume_ms = (state.t_resumed - (state.t_freeze or t_dump)) * 1000
    sent = state.image_bytes + tunnel.bytes_out
    log.info("moved %s lazily to %s as pid %d: resumed after %.0f ms, all %d bytes after %.0f ms (page tunnel: "
             "%d messages out, %d in carrying %d bytes)", move.job_id or pid, req.to, target_pid, resume_ms, sent,
             (t_criu_done - (state.t_freeze or t_dump)) * 1000, tunnel.msgs_out, tunnel.msgs_in, tunnel.bytes_in,
             extra={"checkpoint_id": ckpt_id})
    return MoveResult(target_pid=target_pid, checkpoint_id=ckpt_id, phases=list(phases.items),
                              downtime_ms=int(resume_ms), bytes_sent=sent, target_job=moved_job)


def lazy_preflight(req: MoveRequest, criu: CriuApi) -> None:
    """What a lazy move cannot do, refused before the job is touched."""
    if req.via_store:
        raise InvalidArgument("--lazy and --via-store exclude each other: a lazy move serves the memory from "
                              "this node, not from the store")
    if req.tcp_established:
        raise InvalidArgument("--lazy cannot keep TCP connections (--tcp-established): a failed lazy move "
                              "could not give them back here; move without --lazy")
    if not criu.lazy_pages_supported():
        raise FailedPrecondition("migration failed at preflight: CRIU cannot do lazy pages on this node "
                                 "(no userfaultfd; see 'criu check --feature lazy_pages'); move without --lazy")
    problem = pipe_size_problem()
    if problem:
        raise FailedPrecondition(f"migration failed at preflight: {problem}; the job was not touched")


__all__ = ["end_lazy_dump", "lazy_dump", "lazy_preflight", "move_lazily"]
