"""The target side of a move: receive the image, restore it, keep it once the source commits, or kill it
when the source never does (expiry, and recovery after a crash).

    ReceiveImage      -> stream.ImageReceiver: verified, re-signed with this node's key, published
    RestoreReceived   -> restore (lazy: over the page tunnel; early resume: paged in from the tier copy),
                         journal move_pending=JOB, arm the expiry timer
    commit            -> move_pending cleared; remembered, so a retried commit is answered too
    expiry / restart  -> a still pending move is abandoned: its job killed (the source runs it)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from memsnap import containers, failpoints, lifecycle, proc
from memsnap.auth import call_token, transfer_key
from memsnap.catalog import DURABLE, CheckpointRecord
from memsnap.convert import job_pb
from memsnap.engine import ROOT, Caller, RestoreResult
from memsnap.errors import FailedPrecondition, IntegrityFailure, InvalidArgument, MemsnapError, PermissionDenied
from memsnap.malloc import bulk_transfer
from memsnap.move.channel import ImageChannel
from memsnap.move.network import IncomingAddress
from memsnap.move.plan import MoveHost, set_mark
from memsnap.move.stream import CKPT_ID, ImageReceiver
from memsnap.move.tunnel import TunnelHost, forget_lazy_image
from memsnap.repository import adopted_record
from memsnap.v1 import memsnap_pb2 as pb

log = logging.getLogger("memsnap.move")

# A restored job whose move the source does not commit within this time is killed on the target
# (daemon.move_commit_timeout_s).
COMMIT_TIMEOUT_S = 120.0

# Starts fn after so many seconds, in the background (tests pass a fake one to fire it themselves).
Timer = Callable[[float, Callable[[], None]], Any]


def start_timer(seconds: float, fn: Callable[[], None]) -> threading.Timer:
    """A daemon threading.Timer that calls fn after seconds."""
    timer = threading.Timer(seconds, fn)
    timer.daemon = True
    timer.start()
    return timer


class MoveTarget:
    """ReceiveImage, PageTunnel, RestoreReceived and the commit, on the node a job moves to."""

    def __init__(self, host: MoveHost, commit_timeout_s: float = COMMIT_TIMEOUT_S,
                 timer: Timer = start_timer) -> None:
        self.engine = host
        self.commit_timeout_s = commit_timeout_s
        self._timer = timer
        self.tunnels = TunnelHost(host)
        self.channel: ImageChannel | None = None  # the image channel, when the daemon opened one (daemon.image_port)
        self._commit_lock = threading.Lock()
        self._committed: dict[str, str] = {}

    def receive(self, caller: Caller, chunks: Iterator[pb.ImageChunk],
                context: grpc.ServicerContext) -> pb.ReceiveImageResponse:
        """Peer side: receives and verifies an image into the tier."""
        if not caller.is_root:
            raise PermissionDenied("only a peer daemon (authenticated over TCP) or root may send images")
        token = call_token()
        if not token:
            raise FailedPrecondition(
                "images are received only from a peer that authenticated with a token over TCP: the manifest "
                "must be signed with a key from a secret shared with the source (daemon.auth_token_file or "
                "peers.token_file on both nodes)")
        key = transfer_key(token)
        receiver = ImageReceiver(self.engine, key, self.channel, cancelled=lambda: not context.is_active())
        context.add_callback(receiver.cancel)
        with bulk_transfer():
            ckpt_id, total = receiver.receive(chunks)
        log.info("received image %s: %d bytes", ckpt_id, total, extra={"checkpoint_id": ckpt_id})
        self._timer(self.commit_timeout_s, lambda: self._expire_incoming(ckpt_id))
        return pb.ReceiveImageResponse(checkpoint_id=ckpt_id, bytes=total)

    def restore_received(self, caller: Caller, req: pb.RestoreReceivedRequest,
                         context: grpc.ServicerContext) -> pb.RestoreResponse:
        """Peer side: takes the moved address, restores the received image, checks that the job runs."""
        if not caller.is_root:
            raise PermissionDenied("only a peer daemon (authenticated over TCP) or root may restore moves")
        tunnel = None
        early = req.early_resume and not req.lazy and not req.tcp_established and \
            self.engine.criu.lazy_pages_supported()  # (else a plain restore: the reply comes later)
        if req.lazy:
            if req.tcp_established or req.HasField("from_store"):
                raise InvalidArgument("a lazy move keeps no TCP connections and reads nothing from the store")
            tunnel = self.tunnels.claim(req.lazy_tunnel, req.checkpoint_id)
        if req.HasField("from_store"):
            self._catalog_stored(req.from_store)
        address = IncomingAddress(req.add_ip, req.add_ip_dev, req.tcp_established)
        try:
            address.bring_up()
            opts = {"network_lock_skip": True} if req.tcp_established else None
            try:
                res = self.engine.restore_own_log(ROOT, req.checkpoint_id, moved=True,
                                          tcp_established=req.tcp_established,
                                          notify=address.notify(), restore_opts=opts,
                                          lazy=tunnel is not None or early,
                                          lazy_ps_socket=tunnel.criu_end.fileno() if tunnel else -1,
                                          lazy_guard=tunnel.guard if tunnel else None, into=req.into)
            finally:
                if tunnel is not None:
                    tunnel.criu_end.close()  # lazy-pages holds its own copy now
            # Journaled at once: if this daemon dies from here on, its restart kills the copy (the source,
            # which never heard back, resumes its own).
            self._journal_pending(req.checkpoint_id, res.job.id)
            paged_ms = self._wait_paged_in(res) if early else 0
            if not proc.alive(res.pid):
                raise FailedPrecondition(f"the restored job (pid {res.pid}) exited at once; see its log")
        except BaseException as exc:
            if tunnel is not None:
                self.tunnels.failed(tunnel, f"the lazy restore failed: {exc}")
            self._journal_pending(req.checkpoint_id, "")  # (the copy here is dead: nothing to commit)
            address.failed()
            if not drop_incoming(self.engine, req.checkpoint_id):  # (the job runs on at the source: no copy here)
                self._timer(5.0, lambda: self._expire_incoming(req.checkpoint_id))  # (lazy-pages still ends)
            raise
        address.done()
        self._arm_expiry(req.checkpoint_id, res.job.id)
        if tunnel is not None:
            self.tunnels.watch(tunnel, res.lazy_server, res.pid, res.job.id)
        failpoints.hit("before-restore-reply")
        return pb.RestoreResponse(pid=res.pid, job=job_pb(res.job, True), restore_ms=int(res.restore_ms),
                                  verify_ms=int(res.verify_ms), fetch_ms=int(res.fetch_ms),
                                  from_store=res.from_store, paged_in_ms=paged_ms)

    # -- the commit step -------------------------------------------------------------------------
    def _journal_pending(self, ckpt_id: str, job_id: str) -> None:
        """Journals a restored, not yet committed move ("" clears it)."""
        lifecycle.mark(self.engine.catalog, ckpt_id, move_pending=job_id or None)

    def _arm_expiry(self, ckpt_id: str, job_id: str) -> None:
        """The move dies here unless the source commits within commit_timeout_s of the reply (or of the
        last lazy page)."""
        self._timer(self.commit_timeout_s, lambda: self._expire(ckpt_id, job_id))

    def commit_move(self, caller: Caller, ckpt_id: str) -> pb.RestoreResponse:
        """Peer.CommitMove: the source confirmed and let go of its copy (see commit)."""
        if not caller.is_root:
            raise PermissionDenied("only a peer daemon (authenticated over TCP) or root may commit moves")
        return self.commit(ckpt_id)

    def commit(self, ckpt_id: str) -> pb.RestoreResponse:
        """The source confirmed and lets go of its copy: the job restored from ckpt_id stays (idempotent)."""
        failpoints.hit("before-commit")
        with self._commit_lock:
            rec = self.engine.catalog.get_checkpoint(ckpt_id)
            job_id = rec.meta.get("move_pending", "") if rec is not None else ""
            if not job_id:
                job_id = self._committed.get(ckpt_id, "") or self._kept_before(ckpt_id)
            job = self.engine.catalog.get_job(job_id) if job_id else None
            if job is None or job.ended or not proc.alive(job.pid, job.pid_start):
                raise FailedPrecondition(f"no job moved from {ckpt_id} runs here; the source keeps its copy")
            self._committed[ckpt_id] = job_id  # (a retried commit whose reply was lost is answered too)
            while len(self._committed) > 256:
                self._committed.pop(next(iter(self._committed)))
            if rec is not None:
                lifecycle.mark(self.engine.catalog, ckpt_id, move_pending=None, move_incoming=None, placeholder=None)
                if rec.meta.get("pages_remote"):
                    self.tunnels.committed(ckpt_id)
                elif rec.state != DURABLE and self.engine.drain is not None:
                    self.engine.drain.enqueue(ckpt_id)  # (the image is this job's now: store it)
        failpoints.hit("commit-then-die")  # (the reply is lost)
        return pb.RestoreResponse(pid=job.pid, job=job_pb(job, True))

    def _kept_before(self, ckpt_id: str) -> str:
        """The job a commit kept here before this daemon restarted (the source asks again after a crash).

        A restored move that is not pending any more was either committed (its job runs on) or abandoned
        (its job was killed and ended), so a live job restored from ckpt_id means the commit happened.
        """
        live = self.engine.live_jobs_restored_from(ckpt_id)
        return live[0].id if live else ""

    def _expire(self, ckpt_id: str, job_id: str) -> None:
        if self.tunnels.busy(ckpt_id):
            self._arm_expiry(ckpt_id, job_id)  # a lazy move still brings pages: the source commits after
            return
        with self._commit_lock:
            rec = self.engine.catalog.get_checkpoint(ckpt_id)
            if rec is None or rec.meta.get("move_pending") != job_id:
                return
            log.warning("the source never committed the move of %s: killing it here (the source runs it)",
                        job_id, extra={"checkpoint_id": ckpt_id})
            abandon_move(self.engine, rec)

    def _expire_incoming(self, ckpt_id: str) -> None:
        """An image received for a move that never restored here (the source gave up, or died) goes."""
        rec = self.engine.catalog.get_checkpoint(ckpt_id)
        if rec is None or not rec.marks.move_incoming or rec.marks.move_pending:
            return  # (committed, dropped already, or restored: the pending move's own expiry decides)
        if self.tunnels.busy(ckpt_id) or not drop_incoming(self.engine, ckpt_id):
            self._timer(self.commit_timeout_s, lambda: self._expire_incoming(ckpt_id))  # (a restore reads it)

    def _wait_paged_in(self, res: RestoreResult) -> int:
        """Early resume: waits until lazy-pages has put every page in place; ms the job ran meanwhile."""
        t0 = time.monotonic()
        failpoints.hit("paging-in")
        assert res.lazy_server is not None  # (a lazy restore's result: its lazy-pages process)
        rc = res.lazy_server.wait()
        self.engine.reap_lazy()
        if rc != 0:
            # Its supervisor killed the job already (missing pages would read as zeros).
            proc.kill_tree(res.pid)
            self.engine.catalog.update_job(res.job.id, ended=True)
            raise FailedPrecondition(f"paging in the restored job's memory failed (lazy-pages exit {rc}, see "
                                     f"{res.work_dir}/lazy-pages.log); the copy there was killed")
        return max(1, int((time.monotonic() - t0) * 1000))

    def _catalog_stored(self, info: pb.CheckpointInfo) -> None:
        """Catalogs a durable checkpoint another node wrote to the shared store, so restore can fetch it."""
        if not CKPT_ID.match(info.id):
            raise InvalidArgument(f"{info.id!r} is not a checkpoint id")
        if self.engine.catalog.get_checkpoint(info.id) is not None:
            return
        if self.engine.repo is None:
            raise FailedPrecondition("this node has no store configured, so it cannot fetch a stored "
                                     "checkpoint")
        # Adopted as any stored copy is: from its signed manifest (the peer names only the id). move_incoming
        # "store": the source's stored copy, only cataloged here; a move that fails forgets it here and never
        # deletes it from the store. No home: once the move commits, the job and its stored copy are ours.
        rec = adopted_record(self.engine.repo.signed_manifest(info.id))
        if (rec.job, rec.owner_uid) != (info.job, int(info.owner_uid)):
            raise IntegrityFailure(f"integrity check failed: the stored manifest of {info.id} is job {rec.job!r} "
                                   f"of uid {rec.owner_uid}, not the job the source moves")
        rec.meta["move_incoming"] = "store"
        lifecycle.begin(self.engine.catalog, rec)


# -- recovery (Engine.recover calls these through engine.MoveRecovery) ---------------------------------
def abandon_move(host: MoveHost, rec: CheckpointRecord) -> None:
    """Kills the job restored here for a move that the source did not commit (it resumed its copy)."""
    job_id = rec.marks.move_pending
    job = host.catalog.get_job(job_id) if job_id else None
    if job is not None and not job.ended and proc.alive(job.pid, job.pid_start):
        log.warning("killing %s: its move was never committed, the source runs the job", job.id,
                    extra={"checkpoint_id": rec.id})
        proc.kill_tree(job.pid)
    if job is not None:
        host.catalog.update_job(job.id, ended=True)
    if rec.marks.pages_remote:
        forget_lazy_image(host, rec.id)
    else:
        set_mark(host.catalog, rec.id, move_pending=None)
        drop_incoming(host, rec.id)


def drop_incoming(host: MoveHost, ckpt_id: str) -> bool:
    """Takes away what a move that did not happen brought here: the image it sent (tier, catalog, this node's
    store), or the catalog row and tier copy of the source's stored copy (a move via the store: that stays in
    the store). False while a restore still reads the tier copy (the caller tries again later)."""
    rec = host.catalog.get_checkpoint(ckpt_id)
    if rec is None or not rec.marks.move_incoming:
        return True  # (committed: the job's own checkpoint now)
    containers.drop_journaled(host.catalog, ckpt_id)  # (a container's placeholder, with the copy in it)
    if rec.marks.pages_remote:
        forget_lazy_image(host, ckpt_id)
        return True
    if host.tier_copy_in_use(ckpt_id):
        return False
    if rec.marks.move_incoming == "store":
        host.catalog.update_checkpoint(ckpt_id, in_store=False)  # (delete must not touch the source's copy)
    try:
        host.delete(ROOT, ckpt_id)
    except MemsnapError as exc:
        log.warning("could not drop %s, the image of a move that did not happen: %s", ckpt_id, exc,
                    extra={"checkpoint_id": ckpt_id})
        return False
    log.info("dropped %s: its move did not happen (the job runs on at the source)", ckpt_id,
             extra={"checkpoint_id": ckpt_id})
    return True


def recover_lazy_target(host: MoveHost, rec: CheckpointRecord) -> None:
    """The target half of a lazy move that was in flight (a committed one has no row left): whether or
    not every page arrived, the source never let go of its copy, so this one goes."""
    for job in host.live_jobs_restored_from(rec.id):
        log.warning("killing %s: its lazy move was never committed by the source", job.id)
        proc.kill_tree(job.pid)
        host.catalog.update_job(job.id, ended=True)
    forget_lazy_image(host, rec.id)


__all__ = ["COMMIT_TIMEOUT_S", "MoveTarget", "abandon_move", "drop_incoming", "recover_lazy_target"]
