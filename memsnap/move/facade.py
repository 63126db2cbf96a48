"""Moving a running job to another node's daemon: Mover picks the kind of move (streamed, via the
store, lazy) and runs the source side; MoveTarget (target.py) serves the other end.

The package: plan (move record, phases, rollback, commit, moves in doubt), stream (image sender and
receiver), target (receive, restore, commit, expiry, recovery), lazy (post-copy), network (the IP move).

Source: preflight (target reachable, authenticated, room in its tier) -> lock the job's TCP connections
(with --tcp-established) -> CRIU dumps the job into the tier and leaves it stopped, while every image
file streams to the target as soon as CRIU has closed it (pages-*.img while it grows) -> the manifest
goes last -> the target verifies and restores -> once the target says the job runs, the stopped copy
here is killed. Any failure before that resumes the job here and names the step that failed.

Trust: the source sends only to a configured peer ([[peers]]), with that peer's credential: the token
shared with it (peers.token_file) or one derived from the node token for it (auth.peer_credential);
the node token itself never leaves. Only root may name another address, with a credential of its own
(to_token). The manifest that crosses the wire is signed with a key derived from that credential
(auth.transfer_key), and every chunk and file carries a blake3 checksum. The target checks both, with
the key of the credential the call authenticated with (a move without one is refused), then re-signs
the manifest with its own node key: node HMAC keys never leave their node. A move via shared storage
(--via-store) reads the copy the drain wrote, signed with the source's node key, so both nodes must
share security.hmac_key_file for that path.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from memsnap import background, containers, knobs, manifest, net, proc, progress
from memsnap.auth import RemoteConfigError, load_credentials, transfer_key
from memsnap.catalog import DURABLE, FAILED, CheckpointRecord
from memsnap.client import ClientError, Target
from memsnap.config import Config, parse_host_port
from memsnap.convert import ckpt_pb
from memsnap.criu import NotifyHandlers
from memsnap.engine import ROOT, Caller, DumpExtras
from memsnap.errors import FailedPrecondition, InvalidArgument, MemsnapError, PermissionDenied, TierExhausted
from memsnap.malloc import bulk_transfer
from memsnap.move import network
from memsnap.move.lazy import lazy_preflight, move_lazily
from memsnap.move.peer import Dial, PeerClient, dial
from memsnap.move.plan import (
    CONFIRM_S,
    TRANSPORT_CODES,
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
from memsnap.move.target import MoveTarget, abandon_move, recover_lazy_target
from memsnap.v1 import memsnap_pb2 as pb

log = logging.getLogger("memsnap.move")

# A move via the store waits this long (or this many failed drain attempts) for the durable copy.
_VIA_STORE_WAIT_S = 600.0
_VIA_STORE_ATTEMPTS = 3


class Mover:
    """Moves of one daemon: the source side here, the target side in self.target (MoveTarget)."""

    def __init__(self, engine: MoveHost, cfg: Config, dial: Dial = dial) -> None:
        self.engine = engine
        self.cfg = cfg
        self._dial = dial  # (the transport to targets: tests hand in an in-process one)
        try:
            self.creds = load_credentials(cfg)
        except RemoteConfigError as exc:
            raise SystemExit(f"memsnapd: {exc}") from exc
        self.commits = Commitments(engine, cfg)
        self.target = MoveTarget(engine, commit_timeout_s=cfg.daemon.move_commit_timeout_s)
        self.tunnels = self.target.tunnels
        self._in_doubt: list[str] = []  # found by recovery, settled by recover()

    def moves_in_doubt(self) -> list[str]:
        """"JOB -> HOST:PORT" for every outgoing move whose commit is unanswered (status, metrics)."""
        return self.commits.moves_in_doubt()

    # -- engine.MoveRecovery: Engine.recover hands these over -----------------------------------------
    def in_doubt(self, rec: CheckpointRecord) -> None:
        """The source died while asking the target to keep the job: the copy here stays stopped until
        recover() has asked again."""
        self._in_doubt.append(rec.id)

    def abandon(self, rec: CheckpointRecord) -> None:
        """Restored here for a move that the source never committed: it runs the job itself."""
        abandon_move(self.engine, rec)

    def lazy_target_interrupted(self, rec: CheckpointRecord) -> None:
        """The target half of a lazy move that was in flight when this daemon died."""
        recover_lazy_target(self.engine, rec)

    def recover(self) -> None:
        """At start, after Engine.recover(moves=self): no move of this daemon is in flight any more.

        Network locks a killed memsnapd left would drop the moved addresses' TCP traffic for good: they go.
        Moves whose commit was unanswered when it died are settled in the background (Commitments.settle).
        """
        for table in network.remove_stale_locks():
            log.warning("removed network lock %s, left by a memsnapd that died during a move", table)
        ids, self._in_doubt = self._in_doubt, []
        self.commits.settle(ids, self._connect)

    @contextmanager
    def _connect(self, to: str) -> Iterator[PeerClient]:
        with self._target_client(MoveRequest(target="", to=to), ROOT)[0] as client:
            yield client

    # -- the target side (the servicer calls these) ---------------------------------------------------
    def receive(self, caller: Caller, chunks: Iterator[pb.ImageChunk],
                context: grpc.ServicerContext) -> pb.ReceiveImageResponse:
        """ReceiveImage: see MoveTarget.receive."""
        return self.target.receive(caller, chunks, context)

    def restore_received(self, caller: Caller, req: pb.RestoreReceivedRequest,
                         context: grpc.ServicerContext) -> pb.RestoreResponse:
        """RestoreReceived: see MoveTarget.restore_received."""
        return self.target.restore_received(caller, req, context)

    def commit_move(self, caller: Caller, ckpt_id: str) -> pb.RestoreResponse:
        """CommitMove: see MoveTarget.commit."""
        return self.target.commit_move(caller, ckpt_id)

    # -- source ---------------------------------------------------------------------------------
    def _target_client(self, req: MoveRequest, caller: Caller) -> tuple[PeerClient, str]:
        """A client for the move's target and the credential it carries (which also keys the transfer).

        The target must be a configured peer (by name or address), and gets that peer's credential.
        Root alone may name another address, with a credential of its own (to_token): this node's own
        secrets never go to an address that a caller chose."""
        d = self.cfg.daemon
        peer = self.cfg.peer(req.to)
        address = peer.address if peer is not None else req.to
        try:
            parse_host_port(address)
        except ValueError as exc:
            raise InvalidArgument(f"--to {req.to[:200]!r} is neither a configured peer nor HOST:PORT") from exc
        if peer is None and not (caller.is_root and req.to_token):
            hint = ("add it to [[peers]] in memsnap.toml, or (root) pass a credential that it accepts with "
                    "--token-file" if caller.is_root else "ask the administrator to add it to [[peers]]")
            raise PermissionDenied(f"{req.to[:200]} is not a configured peer of this node: jobs move only to "
                                   f"peers; {hint}")
        token = req.to_token or (self.creds.outbound(peer) if peer is not None else "")
        if not token:
            raise FailedPrecondition(
                f"no credential for peer {req.to[:200]}: a move needs a secret shared with the target to sign "
                "the image; set daemon.auth_token_file (the same node token on both nodes) or peers.token_file")
        # Node certificates serve as client certificates between daemons (mutual TLS clusters).
        tls = {"tls_ca": d.tls_ca, "tls_cert": d.tls_cert, "tls_key": d.tls_key} if d.tls_ca else {}
        return self._dial(Target(address=address, token=token, **tls)), token

    def migrate(self, caller: Caller, req: MoveRequest) -> MoveResult:
        """Moves a job to req.to; on failure the job runs on here and the error names the step."""
        t0 = time.monotonic()
        try:
            with bulk_transfer():
                resp = self._migrate(caller, req)
        except Exception:
            self.engine.observe("migrate", "error", time.monotonic() - t0)
            raise
        self.engine.observe("migrate", "ok", time.monotonic() - t0)
        return resp

    def _migrate(self, caller: Caller, req: MoveRequest) -> MoveResult:
        phases = Phases()
        named = containers.parse_target(req.target)
        if named is not None:  # (a container's workload: memsnap.containers)
            if not req.into:
                raise InvalidArgument(f"moving container {req.target[:80]} needs --into {named[0]}:NAME, the "
                                      "placeholder to start on the target")
            if req.tcp_established or req.move_ip:  # (it takes the placeholder's address on the target)
                raise FailedPrecondition("a container's network identity on the target is its placeholder's: drop "
                                         "--tcp-established and --move-ip")
        plan = containers.plan_for(req.target, caller.is_root)
        if plan is not None:
            binds = [f"{v['source']}:{v['destination']}" for v in plan.facts.volumes if v["kind"] == "bind"]
            if binds:  # (the target refuses them too: a peer names no host paths there)
                raise FailedPrecondition(f"container {req.target[:80]} bind-mounts host paths "
                                         f"({', '.join(binds)[:200]}): those are this node's, so it does not move; "
                                         "use named volumes")
            pid, job = plan.pid, None
        elif req.into:
            raise InvalidArgument(f"--into names the placeholder of a container's move; {req.target[:80]} is not "
                                  "a container (podman:NAME, cri:ID)")
        else:
            pid, job = self.engine.resolve_pid(req.target, caller)
        try:
            owner = proc.owner_uid(pid)
        except proc.ProcessNotFound as exc:
            raise move_error("NOT_FOUND", str(exc)) from exc
        if not caller.is_root and caller.uid != owner:
            raise PermissionDenied(f"uid {caller.uid} may not move pid {pid} owned by uid {owner}")
        if req.lazy:
            lazy_preflight(req, self.engine.criu)
        if self.engine.gpu is not None and self.engine.gpu.describe(pid):
            raise FailedPrecondition("jobs that use CUDA cannot be moved yet")
        moved_ip = network.parse_moved_ip(req.move_ip)
        if req.tcp_established:
            network.require_nft()
        # A lazy move puts only the small images into the target's tier; the memory goes to the job.
        estimate = 0 if req.lazy else int(proc.tree_rss(pid) * (1 + self.cfg.tier.reserve_margin))
        client, token = self._target_client(req, caller)
        with client:
            try:
                st = client.status(timeout=10)
            except ClientError as exc:
                raise move_error(exc.code.name, f"migration failed at preflight: target {req.to} said "
                             f"{exc.code.name}: {exc.message}; the job was not touched") from exc
            listening = proc.tcp_listeners(pid) if st.net_ns and st.net_ns == proc.net_ns_id() else []
            if listening:
                # One host, one network: the stopped copy here holds the ports, so the copy there cannot bind them.
                raise FailedPrecondition(
                    f"migration failed at preflight: {req.to[:200]} shares this node's network (one network "
                    f"namespace), and the job listens on TCP port {', '.join(map(str, listening))}: its copy there "
                    "could not take the port while this one holds it; move it to a node with a network of its own. "
                    "The job was not touched")
            if st.tier_free_bytes < estimate + RESERVE_SLACK:
                raise TierExhausted(
                    f"migration failed at preflight: the target's tier has {st.tier_free_bytes >> 20} MiB "
                    f"free but the job needs about {(estimate + RESERVE_SLACK) >> 20} MiB; the job was not "
                    "touched")
            if req.via_store:
                self._same_store(req, st.store_id)
            phases.mark("preflight")
            move = Move(pid=pid, job_id=job.id if job else "", moved_ip=moved_ip, container=plan)
            if req.lazy:
                progress.phase("lazy move")  # (memsnapctl's display: no byte count from here)
                return move_lazily(self.engine, self.commits, caller, req, client, token, move, phases)
            if req.via_store:
                return self._via_store(caller, req, client, move, phases)
            with background.gate().foreground("move"):  # the job waits stopped until the verdict
                return self._streamed(caller, req, client, token, move, estimate, phases, st.image_port)

    def _dump_held(self, caller: Caller, req: MoveRequest, move: Move,
                   extras: DumpExtras) -> CheckpointRecord:
        """Dumps with the job left stopped; locks its connections and moves the address off this node."""
        if req.tcp_established:
            move.lock = network.source_lock(move.pid, move.moved_ip)
            extras.dump_opts["network_lock_skip"] = True

        def dumped() -> None:
            # The image is complete and the tree still frozen: the address may leave now.
            if move.moved_ip is not None:
                move.ip_removed_from = net.remove_address(move.moved_ip, req.move_ip_dev_source)

        extras.notify = NotifyHandlers(post_dump=dumped)
        extras.hold = True
        extras.dump_opts["skip_in_flight"] = not req.fail_on_in_flight
        if move.container is not None:
            extras.container = move.container.facts
            extras.dump_opts = {**move.container.dump_opts, **extras.dump_opts}
        try:
            if move.lock is not None:
                move.lock.acquire()
            return self.engine.checkpoint(caller, str(move.pid), tcp_established=req.tcp_established,
                                          extras=extras)
        except Exception as exc:
            # CRIU resumed the job itself (a failed dump leaves it running); undo the network side.
            restore_network(move)
            if isinstance(exc, net.NetError):
                raise FailedPrecondition(f"migration failed at dump: {exc}; the job runs on here") from exc
            if isinstance(exc, MemsnapError):
                raise move_error(exc.code, f"migration failed at dump: {exc}") from exc
            raise

    def _streamed(self, caller: Caller, req: MoveRequest, client: PeerClient, token: str,
                  move: Move, estimate: int, phases: Phases, st_image_port: int) -> MoveResult:
        # MEMSNAP_MIGRATE_SERIAL=1 on the source turns pipelining off: the benchmark's baseline.
        streamer = ImageStreamer(client, estimate, pipelined=not knobs.migrate_serial(),
                                 channel=self._image_channel(client, st_image_port))
        extras = DumpExtras(before_dump=streamer.start, file_table=streamer.file_table)
        progress.phase("dump+transfer", estimate, lambda: streamer.bytes_sent)  # (memsnapctl's bar)
        t_dump = time.monotonic()
        try:
            rec = self._dump_held(caller, req, move, extras)
        except BaseException:
            streamer.abort()
            raise
        move.ckpt_id = rec.id
        progress.phase("transfer", rec.size_bytes, lambda: streamer.bytes_sent)
        t_criu_done = phases.mark("dump", streamer.t_criu_done)
        # CRIU's own timers say when the freeze began: freezing + frozen time before it returned.
        freeze_start = t_criu_done - (rec.frozen_ms + float(rec.meta.get("freezing_ms", 0) or 0)) / 1000
        if freeze_start < t_dump:
            freeze_start = t_dump
        try:
            body = {k: v for k, v in manifest.read(self.engine.tier.path(rec.id)).items() if k != "signature"}
            wire = manifest.sign(body, transfer_key(token)) if token else body
            received = streamer.finish(json.dumps(wire, sort_keys=True).encode(), timeout=600)
        except StreamBroken as exc:
            streamer.abort()
            rollback(self.engine, move, "transfer", str(exc), exc.code)
        except manifest.IntegrityError as exc:
            streamer.abort()
            rollback(self.engine, move, "transfer", str(exc), "DATA_LOSS")
        phases.mark("transfer")
        log.info("streamed %d of %d bytes while CRIU was still dumping (%s)", streamer.bytes_at_criu_done,
                 received.bytes, "over the image channel" if streamer.sender else "inside the gRPC call",
                 extra={"checkpoint_id": rec.id})
        return self._restore_on_target(req, client, move, rec, phases, freeze_start, received.bytes)

    @staticmethod
    def _image_channel(client: PeerClient, port: int) -> tuple[str, int] | None:
        """Where the target's image channel listens (its gRPC host, the port its status names), or None:
        the image then goes inside the gRPC call (no channel there, TLS to it, or MEMSNAP_MIGRATE_GRPC)."""
        target = client.client.target
        if not port or target.tls_ca or knobs.migrate_grpc():
            return None
        host, _, _ = target.address.rpartition(":")
        return (host.strip("[]"), port) if host else None

    def _same_store(self, req: MoveRequest, target_store_id: str) -> None:
        """--via-store only works when the target reads the store this node drains to: refuse before the job
        is touched when the stores' ids differ (a hint, not a proof: the signed manifest stays the check)."""
        if self.engine.repo is None:
            raise FailedPrecondition("--via-store needs a store on this node (store.dir or store.url); the job "
                                     "was not touched")
        mine = self.engine.repo.id()
        if not mine or not target_store_id or mine != target_store_id:
            raise FailedPrecondition(
                f"migration failed at preflight: {req.to} does not share this node's store "
                f"({self.engine.repo.describe()}, id {mine or 'unreadable'}; the target's id is "
                f"{target_store_id or 'none'}): --via-store needs one store both nodes reach; move without "
                "--via-store to stream the image instead. The job was not touched")

    def _via_store(self, caller: Caller, req: MoveRequest, client: PeerClient, move: Move,
                   phases: Phases) -> MoveResult:
        if self.engine.drain is None:
            raise FailedPrecondition("--via-store needs a store on this node (store.dir or store.url)")
        t_dump = time.monotonic()
        rec = self._dump_held(caller, req, move, DumpExtras())
        move.ckpt_id = rec.id
        frozen_s = (rec.frozen_ms + float(rec.meta.get("freezing_ms", 0) or 0)) / 1000
        freeze_start = t_dump + max(0.0, rec.dump_ms / 1000 - frozen_s)
        phases.mark("dump")
        progress.phase("drain", rec.size_bytes, lambda: _drained(self.engine, rec.id))
        # The job is frozen meanwhile: give up after a few failed drain attempts rather than retry for long.
        deadline = time.monotonic() + _VIA_STORE_WAIT_S
        with background.gate().urgent(rec.id):  # the frozen job waits for this drain: it never steps aside
            while True:
                cur = self.engine.catalog.get_checkpoint(rec.id)
                if cur is not None and cur.state == DURABLE:
                    rec = cur
                    break
                if (cur is None or cur.state == FAILED or time.monotonic() > deadline
                        or (cur.drain_attempts >= _VIA_STORE_ATTEMPTS and cur.last_error)):
                    why = (cur.last_error or "it took too long") if cur else "the checkpoint vanished"
                    rollback(self.engine, move, "drain", f"the checkpoint did not become durable: {why}",
                             "UNAVAILABLE")
                time.sleep(0.05)
        phases.mark("drain")
        return self._restore_on_target(req, client, move, rec, phases, freeze_start, 0,
                                       from_store=ckpt_pb(rec))

    def _restore_on_target(self, req: MoveRequest, client: PeerClient, move: Move,
                           rec: CheckpointRecord, phases: Phases, freeze_start: float, sent: int,
                           from_store: pb.CheckpointInfo | None = None) -> MoveResult:
        # Early resume: the job runs on the target as soon as its state is back, and pages its memory in
        # from the target's verified copy; the reply comes once all of it is in place. Off for the
        # serial baseline, and with --tcp-established (kept to the plain path that its tests cover).
        early = not (req.plain_restore or req.tcp_established or knobs.migrate_serial())
        rreq = pb.RestoreReceivedRequest(checkpoint_id=rec.id, tcp_established=req.tcp_established,
                                         add_ip=str(move.moved_ip) if move.moved_ip else "",
                                         add_ip_dev=req.move_ip_dev_target, from_store=from_store,
                                         early_resume=early, into=req.into)
        paged_ms = 0
        progress.phase("restore on the target")
        try:
            res = client.restore_received(rreq, timeout=600)
            target_pid, moved_job = int(res.pid), res.job.id
            paged_ms = int(res.paged_in_ms)
        except ClientError as exc:
            why = f"{exc.code.name}: {exc.message}"
            if exc.code not in TRANSPORT_CODES:
                rollback(self.engine, move, "restore on the target", why, exc.code.name)
            # The connection broke during the restore: the job may run there all the same.
            found = target_job(client, rec.id)
            if found is None:
                rollback(self.engine, move, "restore on the target", why, exc.code.name)
            target_pid, moved_job = int(found.pid), found.id
        t_reply = time.monotonic()
        t_running = phases.mark("restore", t_reply - paged_ms / 1000)
        if paged_ms:
            phases.mark("paging", t_reply)  # the job already ran on the target meanwhile
        downtime_ms = (t_running - freeze_start) * 1000
        time.sleep(CONFIRM_S)
        found = target_job(client, rec.id)
        if found is None or found.id != moved_job:
            rollback(self.engine, move, "confirm", f"the restored job {moved_job} is not running on the target",
                           "FAILED_PRECONDITION")
        self.commits.commit_on(client, move, rec.id, req.to)
        phases.mark("confirm")
        # The target runs the job and keeps it: journal that (a crash from here on must not resume the
        # copy here), and only then let the copy here go.
        mark_moved(self.engine.catalog, rec.id, req.to, moved_job)
        self.engine.end_held(move.pid, move.job_id, rec.id)
        if move.lock is not None:
            move.lock.release()
        cur = self.engine.catalog.get_checkpoint(rec.id)
        if self.engine.drain is None or (cur is not None and cur.state != DURABLE):
            # The target holds a verified copy of the same image and drains it itself: draining it here too
            # only doubles the disk and CPU load on both nodes while the job pages in (docs/background.md).
            # A running drain of it stops at its next block.
            background.mark_moved_away(rec.id)
            try:
                self.engine.delete(ROOT, rec.id)
            except MemsnapError as exc:
                log.warning("could not drop the moved image %s: %s", rec.id, exc)
        phases.mark("cleanup")
        log.info("moved %s to %s as pid %d: downtime %.0f ms, %d bytes", move.job_id or move.pid, req.to,
                 target_pid, downtime_ms, sent, extra={"checkpoint_id": rec.id})
        return MoveResult(target_pid=target_pid, checkpoint_id=rec.id, phases=list(phases.items),
                                  downtime_ms=int(downtime_ms), bytes_sent=sent, target_job=moved_job)


__all__ = ["Mover"]


def _drained(engine: MoveHost, ckpt_id: str) -> int:
    """Bytes of ckpt_id drained to the store so far (memsnapctl's bar during a move --via-store)."""
    cur = engine.catalog.get_checkpoint(ckpt_id)
    return cur.size_bytes if cur is not None and cur.state == DURABLE else (cur.drained_bytes if cur else 0)
