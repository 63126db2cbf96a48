"""memsnapd configuration: a TOML file plus dotted-key overrides, validated into frozen dataclasses (each key's
value grammar: memsnap.config_values)."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from memsnap import config_values as val
from memsnap.config_values import Parser
from memsnap.config_values import ip_host_port as ip_host_port  # (re-exported: memsnap.auth, memsnap.move)
from memsnap.config_values import parse_host_port as parse_host_port

DEFAULT_CONFIG_PATH = "/etc/memsnap/memsnap.toml"
OVERRIDE_SOURCE = "override"


class ConfigError(ValueError):
    """A config file or override is unreadable, unknown or has a bad value; the message names it."""


def _opt(default: object, parse: Parser, doc: str) -> Any:
    """Declare a config field with its parser and one-line description."""
    return field(default=default, metadata={"parse": parse, "doc": doc})


# --- sections ----------------------------------------------------------------------------


@dataclass(frozen=True)
class DaemonConfig:
    """[daemon]: API sockets, auth, metrics and logging."""

    socket: str = _opt("/run/memsnap/memsnapd.sock", val.path, "gRPC unix socket path")
    socket_mode: int = _opt(0o660, val.mode, "permissions of the unix socket")
    socket_group: str = _opt("", val.string, "group allowed to use the socket; empty = root's group")
    listen: str = _opt("", val.listen, "HOST:PORT (IP address or host name) for gRPC over TCP; empty = off")
    image_port: int = _opt(
        0, val.int_range(-1, 65535),
        "TCP port, on daemon.listen's address, of the image channel that incoming moves send their bytes over "
        "(sendfile, outside gRPC; not opened with TLS); 0 = any free port, -1 = none (images go inside gRPC)")
    node_name: str = _opt("", val.name_or_empty,
                          "this node's name in its peers' [[peers]] lists; empty = the host name")
    auth_token_file: str = _opt(
        "", val.string, "the node token (cluster secret, mode 0600): peer credentials derive from it; never sent")
    admin_token_file: str = _opt(
        "", val.string, "bearer token that makes a TCP caller an administrator (root); empty = no admin over TCP")
    admin_identities: tuple[str, ...] = _opt(
        (), val.names, "client certificate names (SAN or CN) that are administrators over mutual TLS")
    tls_cert: str = _opt("", val.string, "server certificate (PEM) for TCP")
    tls_key: str = _opt("", val.string, "server private key (PEM) for TCP")
    tls_ca: str = _opt("", val.string, "CA bundle for client certificates (mutual TLS)")
    metrics_listen: str = _opt("", val.listen, "HOST:PORT for the Prometheus exporter; empty = off")
    log_format: str = _opt("text", val.choice("text", "json"), "text or json")
    log_level: str = _opt(
        "info", val.choice("debug", "info", "warning", "error", "critical"), "minimum log level"
    )
    move_in_doubt_s: float = _opt(
        600.0, val.float_min(0.0, False, "a number of seconds >= 0"),
        "how long a job whose outgoing move is in doubt stays stopped here; 0 = until the target answers",
    )
    move_commit_timeout_s: float = _opt(
        120.0, val.POSITIVE_SECONDS,
        "how long a job restored here for an incoming move waits for the source's commit before it is killed "
        "(the source runs it on)",
    )
    private_tmp: bool = _opt(
        True, val.boolean,
        "jobs get a /tmp of their own (a tmpfs whose files travel in their image) unless they ask for the host's "
        "(memsnapctl run --shared-tmp)",
    )


@dataclass(frozen=True)
class TierConfig:
    """[tier]: the memory tier that receives dumps."""

    dir: str = _opt("/dev/shm/memsnap", val.path, "directory on the memory filesystem")
    capacity: int | None = _opt(None, val.size, "bytes usable (K/M/G suffix); empty = fs size")
    reserve_margin: float = _opt(
        0.10,
        val.float_min(0.0, False, "a non-negative fraction such as 0.10"),
        "fraction added to the RSS estimate when reserving",
    )
    kind: str = _opt("tmpfs", val.choice("tmpfs", "numa", "devdax"), "tmpfs, numa or devdax")
    numa_node: int = _opt(-1, val.int_min(-1, "a NUMA node number, or -1 for none"), "-1 = none")
    mount: bool = _opt(False, val.boolean,
                       "memsnapd mounts a tmpfs on dir at start unless dir is a mount point already (never unmounted)")
    huge_pages: str = _opt("auto", val.choice("auto", "within_size", "never", "always", "advise"),
                           "huge= of the tmpfs that tier.mount mounts: auto (within_size, or never on a VM whose host "
                           "takes back freed memory), within_size, never, always or advise")


@dataclass(frozen=True)
class StoreConfig:
    """[store]: durable storage that drains write to."""

    dir: str = _opt("/var/lib/memsnap/store", val.path, "POSIX directory store")
    url: str = _opt("", val.store_url, "s3://bucket/prefix; when set it wins over dir")
    s3_endpoint: str = _opt("", val.string, "S3 endpoint URL; empty = AWS default")
    s3_region: str = _opt("", val.string, "S3 region; empty = SDK default")
    format: str = _opt("chunked", val.choice("chunked", "whole"),
                       "chunked (content-addressed chunks, stored once) or whole (one object per image file)")
    chunk_size: int = _opt(1 << 20, val.chunk_size, "average chunk size (K/M suffix; a multiple of 4K, 16K-16M)")
    chunk_cache_dir: str = _opt("", val.string, "node-local chunk cache; empty = <state dir>/chunk-cache "
                                "(none on the filesystem of store.dir: it would save no trip)")
    chunk_cache_size: int | None = _opt(2 << 30, val.size, "chunk cache cap (K/M/G suffix); empty = no cache")
    pack_size: int | None = _opt(32 << 20, val.size, "a drain's new chunks go into packs of about this size (K/M "
                                 "suffix); empty = an object per chunk")


@dataclass(frozen=True)
class DrainConfig:
    """[drain]: the tier-to-store worker pool."""

    concurrency: int = _opt(2, val.POSITIVE_INT, "parallel drain workers")
    bandwidth: int | None = _opt(None, val.rate, "bytes/s cap (K/M/G suffix, /s optional); empty = unlimited")
    compression_level: int = _opt(3, val.int_range(0, 22), "zstd level; 0 = off")
    compression_threads: int = _opt(0, val.int_min(0, "a non-negative integer"), "zstd threads; 0 = auto")
    retry_initial_s: float = _opt(1.0, val.POSITIVE_SECONDS, "first retry delay")
    retry_max_s: float = _opt(60.0, val.POSITIVE_SECONDS, "longest retry delay")
    max_pause_s: float = _opt(60.0, val.float_min(0.0, False, "a non-negative number of seconds"),
                              "a drain waits for foreground work (dump, restore, lazy paging) at most this "
                              "long in all; 0 = never waits (docs/background.md)")


@dataclass(frozen=True)
class StateConfig:
    """[state]: journal and catalog."""

    dir: str = _opt("/var/lib/memsnap/state", val.path, "journal, catalog and keys")


@dataclass(frozen=True)
class SecurityConfig:
    """[security]: image integrity keys."""

    hmac_key_file: str = _opt("", val.string, "HMAC key; empty = <state dir>/hmac.key")


@dataclass(frozen=True)
class PeerConfig:
    """[[peers]]: a daemon this node trusts to move jobs to and from it (never an administrator)."""

    name: str = _opt("", val.name, "the peer's daemon.node_name")
    address: str = _opt("", val.address, "HOST:PORT where the peer's daemon listens")
    token_file: str = _opt(
        "", val.string, "a token shared with this peer only (mode 0600); empty = derived from the node token")
    identity: str = _opt("", val.string, "the name (SAN or CN) in the peer's certificate; empty = name")

    @property
    def cert_identity(self) -> str:
        """The certificate name this peer authenticates with under mutual TLS."""
        return self.identity or self.name


@dataclass(frozen=True)
class GuardConfig:
    """[guard]: the memory-pressure guard (memsnap.guard): park jobs instead of letting them be OOM killed."""

    enabled: bool = _opt(True, val.boolean, "watch job memory limits and node pressure")
    mode: str = _opt("enforce", val.choice("enforce", "observe"), "enforce parks; observe only logs what it would park")
    cgroup_root: str = _opt("", val.string, "memory cgroup mount; empty = detect (v1 /sys/fs/cgroup/memory, else v2)")
    cgroup_parent: str = _opt("memsnap", val.name, "cgroup under the root that holds one cgroup per limited job")
    headroom: int | None = _opt(None, val.size, "extra bytes given to a job stuck at its limit while it is dumped; "
                                "empty = 16M + 5% of the limit")
    poll_interval_s: float = _opt(0.2, val.POSITIVE_SECONDS, "how often usage, PSI and MemAvailable are sampled")
    psi_path: str = _opt("/proc/pressure/memory", val.path, "PSI file the node policy reads")
    psi_some_avg10: float = _opt(0.0, val.percent, "park when PSI some avg10 stays above this (0 = off)")
    psi_full_avg10: float = _opt(0.0, val.percent, "park when PSI full avg10 stays above this (0 = off)")
    mem_available_min: int | None = _opt(None, val.size, "park when MemAvailable stays below this; empty = off")
    sustain_s: float = _opt(10.0, val.POSITIVE_SECONDS, "pressure must last this long before a park (T)")
    cooldown_s: float = _opt(10.0, val.POSITIVE_SECONDS, "wait this long after a park before parking another")
    auto_resume: bool = _opt(True, val.boolean, "resume parked jobs, highest priority first, once pressure is gone")
    resume_below_some_avg10: float = _opt(5.0, val.percent, "resume only while PSI some avg10 stays below this")
    resume_below_full_avg10: float = _opt(1.0, val.percent, "resume only while PSI full avg10 stays below this")
    resume_sustain_s: float = _opt(30.0, val.POSITIVE_SECONDS, "pressure must stay low this long before a resume (T')")
    resume_margin: int | None = _opt(None, val.size, "MemAvailable must exceed image size + mem_available_min + this; "
                                     "empty = 1G")
    spill_dir: str = _opt("", val.string, "park images go here (a disk directory, DAX or NUMA tmpfs) instead of the "
                          "memory tier; empty = the tier, evicted once durable")
    pressure_level: str = _opt("off", val.choice("off", "low", "medium", "critical"),
                               "cgroup v1: also park a limited job when its cgroup's memory.pressure_level "
                               "reports this level (reclaim against its limit); off = only at the limit")
    durable_wait_s: float = _opt(600.0, val.POSITIVE_SECONDS, "how long a park into the tier waits for the drain "
                                 "before keeping the tier copy")


@dataclass(frozen=True)
class RetentionConfig:
    """[retention]: the default policy of `memsnapctl gc` (a job's own --keep-last/--keep-within win rule by
    rule) and the daemon's periodic gc. Both rules unset: every checkpoint is kept."""

    keep_last: int | None = _opt(None, val.count_or_unset, 'keep the newest N checkpoints of each job; "" = not set')
    keep_within: float | None = _opt(None, val.duration_or_unset,
                                     'keep checkpoints younger than this (e.g. "2h", "7d"); "" = not set')
    gc_interval: float = _opt(3600.0, val.duration, 'how often memsnapd runs gc (e.g. "1h"); 0 = never')
    chunk_grace: float = _opt(86400.0, val.duration, "a store chunk no manifest references is swept only once it "
                              "is older than this (uploads of drains still in flight on any node stay)")


@dataclass(frozen=True)
class QuotaConfig:
    """[quota]: what each uid may use (memsnap.quota, docs/quota.md), checked before any work starts. These apply
    to every uid but root; a [quota.uid.UID] table sets a uid's own (root's too), key by key. "" = no limit."""

    tier_bytes: int | None = _opt(None, val.size, 'bytes of its checkpoints\' memory tier copies (K/M/G suffix); "" = '
                                  "no limit")
    store_bytes: int | None = _opt(None, val.size, 'bytes its durable checkpoints wrote to the store; "" = no limit')
    jobs: int | None = _opt(None, val.count_or_unset, 'running jobs; "" = no limit')
    checkpoints: int | None = _opt(None, val.count_or_unset, 'checkpoints it may restore (staged, draining, durable); '
                                   '"" = no limit')


@dataclass(frozen=True)
class UidQuota:
    """[quota.uid.UID]: one uid's own limits, only the keys it sets (the others: [quota]'s, none for root)."""

    uid: int
    limits: tuple[tuple[str, int | None], ...]


@dataclass(frozen=True)
class Config:
    """The whole effective memsnapd configuration."""

    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    tier: TierConfig = field(default_factory=TierConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    drain: DrainConfig = field(default_factory=DrainConfig)
    state: StateConfig = field(default_factory=StateConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    quota: QuotaConfig = field(default_factory=QuotaConfig)
    quota_uids: tuple[UidQuota, ...] = ()  # [quota.uid.UID] tables, by uid
    peers: tuple[PeerConfig, ...] = ()

    def peer(self, to: str) -> PeerConfig | None:
        """The configured peer named `to`, or whose address is `to` (host compared case-insensitively)."""
        for p in self.peers:
            if p.name == to:
                return p
        try:
            want = parse_host_port(to)
        except ValueError:
            return None
        for p in self.peers:
            host, port = parse_host_port(p.address)
            if (host.lower(), port) == (want[0].lower(), want[1]):
                return p
        return None

    @property
    def hmac_key_path(self) -> str:
        """The HMAC key file, defaulting to <state dir>/hmac.key."""
        return self.security.hmac_key_file or os.path.join(self.state.dir, "hmac.key")

    def to_toml(self) -> str:
        """Render the effective configuration as TOML that load_config reads back unchanged."""
        return _render(self)


SECTIONS: dict[str, type[Any]] = {
    "daemon": DaemonConfig,
    "tier": TierConfig,
    "store": StoreConfig,
    "drain": DrainConfig,
    "state": StateConfig,
    "security": SecurityConfig,
    "guard": GuardConfig,
    "retention": RetentionConfig,
    "quota": QuotaConfig,
}


# --- loading -----------------------------------------------------------------------------


def _read_file(path: str | None) -> tuple[str, dict[str, Any]]:
    """Read the TOML file; a missing default file yields an empty table."""
    source = path or DEFAULT_CONFIG_PATH
    try:
        with open(source, "rb") as handle:
            return source, tomllib.load(handle)
    except FileNotFoundError:
        if path is None:
            return source, {}
        raise ConfigError(f"{source}: no such config file") from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: invalid TOML: {exc}") from None


def _show(value: object) -> str:
    """Show a bad value the way it would be written in TOML."""
    return _toml_value(value) if isinstance(value, str | int | float | bool) else repr(value)


def load_config(path: str | None = None, overrides: Mapping[str, object] | None = None) -> Config:
    """Load path (None = the default, which may be absent), apply dotted-key overrides, validate."""
    source, data = _read_file(path)
    raw: dict[str, dict[str, tuple[object, str]]] = {name: {} for name in SECTIONS}
    peers = _build_peers(source, data.pop("peers", []))
    uids = _build_quota_uids(source, data["quota"].pop("uid", {}) if isinstance(data.get("quota"), dict) else {})
    for section, table in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"{source}: {section}: unknown section")
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: {section}: expected a [{section}] table")
        for key, value in table.items():
            raw[section][key] = (value, source)
    for dotted, value in (overrides or {}).items():
        if value is None:  # an unset CLI flag
            continue
        section, _, key = dotted.partition(".")
        if section not in SECTIONS or not key:
            raise ConfigError(f"{OVERRIDE_SOURCE}: {dotted}: unknown key")
        raw[section][key] = (value, OVERRIDE_SOURCE)
    sections = {name: _build(name, SECTIONS[name], raw[name]) for name in SECTIONS}
    config = Config(**sections, quota_uids=uids, peers=peers)
    _check(config, raw)
    return config


def _build_peers(source: str, tables: object) -> tuple[PeerConfig, ...]:
    """[[peers]] tables: each needs a name and an address, both unique."""
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(f"{source}: peers: expected [[peers]] tables")
    peers: list[PeerConfig] = []
    for i, table in enumerate(tables):
        where = f"peers[{i}]"
        peer = _build(where, PeerConfig, {k: (v, source) for k, v in table.items()})
        for key in ("name", "address"):
            if not getattr(peer, key):
                raise ConfigError(f"{source}: {where}.{key}: required")
        for other in peers:
            if other.name == peer.name:
                raise ConfigError(f"{source}: {where}.name: {peer.name!r} is listed twice")
            if parse_host_port(other.address) == parse_host_port(peer.address):
                raise ConfigError(f"{source}: {where}.address: {peer.address!r} is listed twice")
        peers.append(peer)
    return tuple(peers)


def _build_quota_uids(source: str, tables: object) -> tuple[UidQuota, ...]:
    """[quota.uid.UID] tables: UID a number (SO_PEERCRED gives uids, and a user renamed in /etc/passwd must not
    change what it may use), each key one of [quota]'s."""
    if not isinstance(tables, dict):
        raise ConfigError(f"{source}: quota.uid: expected [quota.uid.UID] tables, such as [quota.uid.1000]")
    out = []
    for uid, table in sorted(tables.items(), key=lambda kv: str(kv[0])):
        where = f"quota.uid.{uid}"
        if not (isinstance(uid, str) and uid.isascii() and uid.isdigit() and int(uid) <= (1 << 32) - 2):
            raise ConfigError(f"{source}: {where}: expected a numeric uid, such as [quota.uid.1000]")
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: {where}: expected a [{where}] table")
        given = _build(where, QuotaConfig, {k: (v, source) for k, v in table.items()})
        out.append(UidQuota(int(uid), tuple((k, getattr(given, k)) for k in table)))
    return tuple(sorted(out, key=lambda q: q.uid))


def _build(name: str, cls: type[Any], values: dict[str, tuple[object, str]]) -> Any:
    """Validate one section's values into its dataclass."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, (value, source) in values.items():
        if key not in fields:
            raise ConfigError(f"{source}: {name}.{key}: unknown key")
        try:
            kwargs[key] = fields[key].metadata["parse"](value)
        except val.Bad as bad:
            raise ConfigError(
                f"{source}: {name}.{key}: expected {bad.expected}, got {_show(value)}"
            ) from None
    return cls(**kwargs)


def _check(config: Config, raw: dict[str, dict[str, tuple[object, str]]]) -> None:
    """Cross-field rules."""

    def fail(section: str, key: str, message: str) -> None:
        source = raw[section].get(key, (None, OVERRIDE_SOURCE))[1]
        raise ConfigError(f"{source}: {section}.{key}: {message}")

    d = config.daemon
    if bool(d.tls_cert) != bool(d.tls_key):
        fail("daemon", "tls_key" if d.tls_cert else "tls_cert", "tls_cert and tls_key go together")
    if d.tls_ca and not d.tls_cert:
        fail("daemon", "tls_ca", "mutual TLS needs tls_cert and tls_key too")
    if d.admin_identities and not d.tls_ca:
        fail("daemon", "admin_identities", "certificate names need mutual TLS (tls_cert, tls_key and tls_ca)")
    if config.drain.retry_max_s < config.drain.retry_initial_s:
        fail("drain", "retry_max_s", "must be at least drain.retry_initial_s")
    if config.tier.kind == "numa" and config.tier.numa_node < 0:
        fail("tier", "numa_node", 'tier.kind = "numa" needs a node number >= 0')
    if config.tier.mount and config.tier.kind == "devdax":
        fail("tier", "mount", 'memsnapd mounts only a tmpfs: mount the DAX filesystem yourself (tier.mount = false)')
    # Each of these directories is memsnapd's whole: at start it removes from a tier what no checkpoint names, so
    # one inside another (a spill dir holding the state dir) would lose data.
    roots = [("tier", "dir", config.tier.dir), ("state", "dir", config.state.dir)]
    if not config.store.url:
        roots.append(("store", "dir", config.store.dir))
    if config.guard.spill_dir:
        roots.append(("guard", "spill_dir", config.guard.spill_dir))
    for i, (sec, key, a) in enumerate(roots):
        for sec2, key2, b in roots[:i]:
            pa, pb = os.path.abspath(a), os.path.abspath(b)
            if os.path.commonpath([pa, pb]) in (pa, pb):
                fail(sec, key, f"{a} and {sec2}.{key2} ({b}) must not be the same directory or lie inside each "
                               "other: give each a directory of its own")


# --- rendering ---------------------------------------------------------------------------


def _toml_string(text: str) -> str:
    """Quote text as a TOML basic string."""
    out = []
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif char == "\n":
            out.append("\\n")
        elif char == "\t":
            out.append("\\t")
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04X}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def _toml_value(value: object) -> str:
    """Format a scalar as TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return _toml_string(str(value))


def _render(config: Config) -> str:
    """Render every section and key, with each key's description as a comment."""
    lines = ["# Effective memsnapd configuration."]
    for name in SECTIONS:
        lines += ["", f"[{name}]"]
        section = getattr(config, name)
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if f.name == "socket_mode":
                text = _toml_string(f"{value:04o}")
            elif value is None:
                text = '""'
            else:
                text = _toml_value(value)
            lines.append(f"{f.name} = {text}  # {f.metadata['doc']}")
    for peer in config.peers:
        lines += ["", "[[peers]]"]
        lines += [f"{f.name} = {_toml_value(getattr(peer, f.name))}  # {f.metadata['doc']}"
                  for f in dataclasses.fields(peer)]
    for q in config.quota_uids:  # (absent keys: [quota]'s; "" = no limit for this uid)
        lines += ["", f"[quota.uid.{q.uid}]"] + [f"{k} = {_toml_value(v) if v is not None else chr(34) * 2}"
                                                 for k, v in q.limits]
    lines.append(f"# hmac key in use: {config.hmac_key_path}")
    return "\n".join(lines) + "\n"
