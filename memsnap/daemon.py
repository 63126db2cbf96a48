"""memsnapd: wires config, engine, drain, gRPC server, relay, metrics and sd_notify together."""

from __future__ import annotations

import argparse
import faulthandler
import fcntl
import importlib
import logging
import os
import signal
import socket
import sys
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from memsnap import failpoints, manifest, safefs
from memsnap.api import MemsnapServicer, PeerServicer
from memsnap.catalog import Catalog
from memsnap.collaborators import GpuAdapter
from memsnap.config import Config, ConfigError, load_config
from memsnap.criu import Criu, CriuError
from memsnap.drain import build_drain, build_repository
from memsnap.engine import ROOT, Engine, EngineConfig
from memsnap.gc import Collector, chunk_sweeper
from memsnap.guard.service import Guard
from memsnap.logs import setup_logging
from memsnap.metrics import Metrics, serve
from memsnap.move import Mover
from memsnap.move.channel import ImageChannel
from memsnap.peercred import PeerCredRelay, SocketInUse, remove_stale_socket
from memsnap.quota import Quotas
from memsnap.retention import Policy
from memsnap.sdnotify import Heartbeat, Notifier
from memsnap.store import StoreError
from memsnap.store.bad_objects import BAD
from memsnap.tier import MemoryTier, MountSpec, TierMountError, resolve_huge_pages
from memsnap.tiers import Tiers
from memsnap.v1 import memsnap_pb2, memsnap_pb2_grpc, peer_pb2, peer_pb2_grpc
from memsnap.version import VersionAction

log = logging.getLogger("memsnap.daemon")

# Flag -> dotted config key; a flag given on the command line wins over the file.
# A graceful stop waits this long for jobs paging in from the store (the unit's TimeoutStopSec is 60 s).
STOP_PAGING_S = 45.0

FLAGS = {
    "socket": "daemon.socket", "listen": "daemon.listen", "image_port": "daemon.image_port",
    "auth_token_file": "daemon.auth_token_file",
    "tls_cert": "daemon.tls_cert", "tls_key": "daemon.tls_key", "tls_ca": "daemon.tls_ca",
    "metrics_listen": "daemon.metrics_listen", "log_format": "daemon.log_format",
    "log_level": "daemon.log_level", "tier_dir": "tier.dir", "tier_capacity": "tier.capacity",
    "store_dir": "store.dir", "store_url": "store.url", "s3_endpoint": "store.s3_endpoint",
    "s3_region": "store.s3_region", "state_dir": "state.dir", "drain_bandwidth": "drain.bandwidth",
    "drain_concurrency": "drain.concurrency", "compression_level": "drain.compression_level",
    "hmac_key_file": "security.hmac_key_file", "move_in_doubt_s": "daemon.move_in_doubt_s",
    "node_name": "daemon.node_name", "admin_token_file": "daemon.admin_token_file",
    "store_format": "store.format", "chunk_size": "store.chunk_size", "pack_size": "store.pack_size",
    "chunk_cache_dir": "store.chunk_cache_dir",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """memsnapd's flags; every one overrides the same key of the config file."""
    p = argparse.ArgumentParser(prog="memsnapd", description="memsnap node daemon")
    p.add_argument("--config", help="TOML config file (default /etc/memsnap/memsnap.toml if present)")
    p.add_argument("--print-config", action="store_true", help="print the effective config and exit")
    p.add_argument("--version", action=VersionAction)
    for flag, key in FLAGS.items():
        p.add_argument("--" + flag.replace("_", "-"), dest=flag, default=None, help=f"overrides {key}")
    return p.parse_args(argv)


class Daemon:
    """One memsnapd: start() serves, stop() shuts down gracefully."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        # State, tier and store roots: real root-owned directories that no one else can write (created here
        # when missing), else memsnapd refuses to start with one line saying why and how to fix it.
        try:
            state = safefs.ensure_root(cfg.state.dir, "state dir", mode=0o711)
            # 0711: job owners reach their logs (state/jobs/<job>.log, theirs, 0600); nothing can be listed.
            safefs.chmod_dir(state, 0o711)
            # One daemon per state dir, socket and port: checked before anything else is touched.
            self._instance_lock = single_instance(state, Path(cfg.daemon.socket), cfg.daemon.listen)
            self.metrics = Metrics()
            BAD.subscribe(self.metrics.count_bad_object)  # (objects in the store drains and gc skip)
            self.catalog = Catalog(state)
            t = cfg.tier
            node = t.numa_node if t.kind == "numa" else -1
            mount = MountSpec(t.capacity or 0, resolve_huge_pages(t.huge_pages), node) if t.mount else None
            if mount is not None and t.huge_pages == "auto" and mount.huge_pages == "never":
                log.info("memory tier %s: 4 KiB pages (tier.huge_pages = auto): this VM's host takes back the memory "
                         "the guest frees, and huge pages would come back from it at every dump", t.dir)
            self.tier = Tiers(MemoryTier(t.dir, t.capacity or 0, t.kind, mount), self._spill_tier())
            self.criu = Criu(plugin_dir=state / "criu-plugins")
            key = manifest.load_or_create_key(Path(cfg.hmac_key_path))
            self.repo = build_repository(cfg, self.catalog, self.tier, key, self.metrics)
            self.drain = build_drain(cfg, self.catalog, self.tier, self.repo, self.metrics)
        except (safefs.UnsafePath, StoreError, TierMountError) as exc:
            raise SystemExit(f"memsnapd: {exc}") from exc
        self.engine = Engine(
            EngineConfig(state_dir=state, reserve_margin=cfg.tier.reserve_margin,
                         private_tmp=cfg.daemon.private_tmp, node_name=cfg.daemon.node_name),
            self.catalog, self.tier, self.criu, key, drain=self.drain, repo=self.repo, gpu=_load_gpu(),
            observe=self._observe,
        )
        self.engine.guard = self.guard = Guard(self.engine, cfg.guard, state, self.metrics)
        self.gc = self._make_gc()
        self.quota = Quotas(cfg.quota, cfg.quota_uids, self.engine)  # [quota]: what each uid may use
        self.notifier = Notifier.from_env(unset=True)
        self._stopped = threading.Event()
        self._servers: list[Any] = []
        self._threads: list[Any] = []
        self.migrator: Mover | None = None
        self.image_channel: ImageChannel | None = None

    def _spill_tier(self) -> MemoryTier | None:
        """The guard's spill tier (guard.spill_dir): where park images go instead of the memory tier."""
        if not self.cfg.guard.spill_dir:
            return None
        try:
            return MemoryTier(self.cfg.guard.spill_dir, 0, "tmpfs", label="spill tier (guard.spill_dir)")
        except safefs.UnsafePath as exc:
            raise SystemExit(f"memsnapd: {exc}") from exc

    def _make_gc(self) -> Collector:
        """Retention and the chunk sweep (memsnap.gc), with the [retention] defaults."""
        r = self.cfg.retention
        return Collector(self.engine, Policy(r.keep_last, r.keep_within), r.chunk_grace,
                         chunk_sweeper(self.repo, self.catalog, r.chunk_grace), self.metrics)

    def _observe(self, kind: str, result: str, seconds: float) -> None:
        if kind.startswith("phase:"):  # a phase timed inside an operation (freeze, dump: CRIU's own stats)
            self.metrics.observe_phase(kind.removeprefix("phase:"), seconds)
            return
        counter = {"checkpoint": self.metrics.checkpoints, "restore": self.metrics.restores,
                   "migrate": self.metrics.migrations}.get(kind)
        if counter is not None:
            counter.labels(result=result).inc()
        if result == "ok" and kind == "restore":
            self.metrics.observe_phase("restore", seconds)

    def _status_extra(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"store": self.repo.describe() if self.repo else "none",
                                 "store_id": self.repo.id() if self.repo else "",
                                 "guard": self.guard.describe(), "tier_fs": self.tier.describe()}
        if self.drain is not None:
            extra["drain_queue_depth"], extra["drain_queue_bytes"] = self.drain.queue_stats()
            extra["store_bad_objects"], extra["store_bad_object_count"] = BAD.listed(), len(BAD)
        if self.migrator is not None:
            extra["moves_in_doubt"] = self.migrator.moves_in_doubt()
        if self.image_channel is not None:
            extra["image_port"] = self.image_channel.port
        return extra

    def start(self) -> None:
        """Recovers, then serves; READY=1 is sent only once the socket answers."""
        try:
            version = self.criu.version()
        except CriuError as exc:
            raise SystemExit(f"memsnapd: {exc}") from exc
        migrator = self.migrator = Mover(self.engine, self.cfg)
        fixed = self.engine.recover(moves=migrator)
        log.info("memsnapd starting: criu %s, tier %s (%s), recovered %s", version, self.tier.root,
                 self.tier.describe(), fixed)
        if self.drain is not None:
            self.drain.start(self.engine.pending_drains())

        migrator.recover()
        servicer = MemsnapServicer(self.engine, self._status_extra, migrator=migrator, quota=self.quota, gc=self.gc,
                                   guard=self.guard)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="grpc"),
                             options=[("grpc.max_receive_message_length", 64 << 20),
                                      # a second server on our port must fail, not share it
                                      ("grpc.so_reuseport", 0)],
                             interceptors=self._interceptors())
        memsnap_pb2_grpc.add_MemsnapServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
        peer_pb2_grpc.add_PeerServicer_to_server(PeerServicer(migrator), server)  # type: ignore[no-untyped-call]
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = (memsnap_pb2.DESCRIPTOR.services_by_name["Memsnap"].full_name,
                 health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME,
                 peer_pb2.DESCRIPTOR.services_by_name["Peer"].full_name)
        reflection.enable_server_reflection(names, server)

        private_dir = Path(self.cfg.state.dir) / "private"
        private_dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(private_dir, 0o700)
        private = private_dir / "grpc.sock"
        if private.exists():
            private.unlink()
        if len(str(private)) > 100:
            # A Unix socket path holds at most 107 bytes; a deep state dir is reached through an fd of the
            # private dir instead (this process binds there, and its relay connects there).
            self._private_dirfd = os.open(private_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            private = Path(f"/proc/self/fd/{self._private_dirfd}/grpc.sock")
        server.add_insecure_port(f"unix:{private}")
        self._add_tcp(server)
        server.start()
        self._servers.append(server)
        self.relay = PeerCredRelay(Path(self.cfg.daemon.socket), private, self.cfg.daemon.socket_mode,
                                   self.cfg.daemon.socket_group)
        self.relay.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.health.set(names[0], health_pb2.HealthCheckResponse.SERVING)

        if self.cfg.daemon.metrics_listen:
            host, _, port = self.cfg.daemon.metrics_listen.rpartition(":")
            self.metrics.bind_tier(lambda: float(self.tier.used_bytes()),
                                   lambda: float(self.tier.capacity_bytes()))
            self.metrics.set_tier_info(**self.tier.info())
            if migrator is not None:
                self.metrics.moves_in_doubt.set_function(lambda: float(len(migrator.moves_in_doubt())))
            self.metrics.bind_store(self.gc.totals)
            self.metrics.bind_quota(lambda: self.quota.report(ROOT))
            if (drain := self.drain) is not None:
                self.metrics.bind_drain_queue(lambda: float(drain.queue_stats()[0]),
                                              lambda: float(drain.queue_stats()[1]))
            self._servers.append(serve(self.metrics, host.strip("[]") or "127.0.0.1", int(port)))
            log.info("metrics on http://%s:%d/metrics", self._servers[-1].host, self._servers[-1].port)

        self.guard.start()
        self.gc.start(self.cfg.retention.gc_interval)
        self.notifier.ready()
        self._start_background()
        log.info("memsnapd ready on %s", self.cfg.daemon.socket)
        # numpy (the drain's chunk cutter) is left out of the start (~90 ms) and imported now, beside the serving:
        # otherwise the first drain after every start paid for it.
        threading.Thread(target=importlib.import_module, args=("numpy",), name="preload", daemon=True).start()

    def _interceptors(self) -> list[Any]:
        """TCP authentication and roles (memsnap.auth; it also refuses the reserved auth header on any socket),
        then, innermost, request decoding: bytes that are no request message get INVALID_ARGUMENT, not
        grpcio's INTERNAL (memsnap.rpc_decode)."""
        from memsnap.auth import RemoteConfigError, interceptors
        from memsnap.rpc_decode import DecodeInterceptor

        try:
            return [*interceptors(self.cfg), DecodeInterceptor()]
        except RemoteConfigError as exc:
            raise SystemExit(f"memsnapd: {exc}") from exc

    def _add_tcp(self, server: grpc.Server) -> None:
        if not self.cfg.daemon.listen:
            return
        from memsnap.auth import RemoteConfigError, add_tcp_port, bind_addresses

        try:
            add_tcp_port(server, self.cfg)
        except RemoteConfigError as exc:
            raise SystemExit(f"memsnapd: {exc}") from exc
        d = self.cfg.daemon
        if d.image_port < 0 or d.tls_cert or self.migrator is None:
            return  # (with TLS the image stays inside gRPC: the channel has no encryption of its own)
        hosts = [a.rpartition(":")[0].strip("[]") for a in bind_addresses(d.listen)]
        try:
            self.image_channel = ImageChannel([(h, d.image_port) for h in hosts])
        except OSError as exc:
            raise SystemExit(f"memsnapd: cannot open the image channel on port {d.image_port} of {d.listen}: "
                             f"{exc.strerror or exc}; choose another daemon.image_port (0: any free port, "
                             "-1: none)") from None
        self.image_channel.start()
        self.migrator.target.channel = self.image_channel
        self._servers.append(self.image_channel)
        log.info("image channel for incoming moves on port %d", self.image_channel.port)

    def _start_background(self) -> None:
        def healthy() -> bool:
            return self.tier.root.is_dir() and not self._stopped.is_set()

        def status() -> str:
            q = self.drain.queue_stats()[0] if self.drain else 0
            return (f"tier {self.tier.used_bytes() >> 20} MiB used, {self.tier.free_bytes() >> 20} MiB free "
                    f"({self.tier.describe()}); drain queue {q}")

        interval = self.notifier.watchdog_interval() or 10.0
        self.heartbeat = Heartbeat(self.notifier, healthy, status, interval)
        self.heartbeat.start()

        def reaper() -> None:
            while not self._stopped.wait(1.0):
                self.engine.launcher.reap()
                self.engine.reap_lazy()

        t = threading.Thread(target=reaper, name="reaper", daemon=True)
        t.start()

    def stop(self) -> None:
        """Graceful stop: jobs keep running; in-flight drains resume at the next start."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.notifier.stopping()
        log.info("memsnapd stopping")
        self.relay.stop()
        self.health.enter_graceful_shutdown()
        for s in self._servers:
            if isinstance(s, grpc.Server):
                s.stop(grace=5).wait(6)
            elif isinstance(s, ImageChannel):
                s.stop()
            else:
                s.shutdown()
        self.guard.stop()
        self.gc.stop()
        from memsnap.pageserver.restore import wait_paged_in  # (its jobs die with this process otherwise)

        left = wait_paged_in(STOP_PAGING_S)
        if left:
            log.warning("%d lazy restores from the store were still paging in; their jobs die with memsnapd", left)
        if self.drain is not None:
            self.drain.stop()
        self.heartbeat.stop()
        self.catalog.close()


def single_instance(state: Path, sock: Path, listen: str) -> int:
    """Takes the state dir's lock and checks that no daemon answers on sock or listens on listen's port;
    exits with a one-line reason otherwise. Returns the lock's fd (held for the daemon's lifetime)."""
    lock_path = state / "memsnapd.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise SystemExit(f"memsnapd: another memsnapd (pid {holder}) uses the state dir {state}; "
                         "stop it first, or give this one its own --state-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    try:
        remove_stale_socket(sock)
    except SocketInUse as exc:
        raise SystemExit(f"memsnapd: {exc}") from None
    if listen:
        host, _, port = listen.rpartition(":")
        if port.isdigit() and int(port):
            try:
                infos = socket.getaddrinfo(host.strip("[]") or None, int(port), type=socket.SOCK_STREAM)
            except OSError:
                infos = []
            for family, kind, proto, _, addr in infos[:1]:
                s = socket.socket(family, kind, proto)
                try:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind(addr)
                except OSError as exc:
                    raise SystemExit(f"memsnapd: cannot listen on {listen}: {exc.strerror} (another memsnapd?); "
                                     "stop it first, or choose another --listen") from None
                finally:
                    s.close()
    return fd


def _load_gpu() -> GpuAdapter | None:
    """The GPU adapter when the NVIDIA driver is present, else None (CPU nodes)."""
    from memsnap.gpu.adapter import load_adapter  # (imported late: CPU-only tools never load memsnap.gpu)

    return load_adapter()


def main(argv: list[str] | None = None) -> None:
    """Entry point of the memsnapd console script."""
    args = parse_args(argv)
    overrides = {key: getattr(args, flag) for flag, key in FLAGS.items() if getattr(args, flag) is not None}
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"memsnapd: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    if args.print_config:
        sys.stdout.write(cfg.to_toml())
        return
    setup_logging(cfg.daemon.log_format, cfg.daemon.log_level)
    failpoints.warn_if_set(log)
    if os.geteuid() != 0:
        print("memsnapd: must run as root (CRIU needs it)", file=sys.stderr)
        raise SystemExit(1)
    # kill -USR1 writes every thread's stack to stderr (the journal): what a daemon that stopped answering waits on
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    daemon = Daemon(cfg)
    stop_requested = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop_requested.set())
    daemon.start()
    # A short wait: the kernel may hand SIGTERM to any of the daemon's threads, and Python runs its handler in
    # the main thread only once that thread runs again (seen once in CI: no "stopping" within 30 s).
    while not stop_requested.wait(1.0):
        pass
    daemon.stop()
    log.info("memsnapd stopped")


if __name__ == "__main__":
    main()
