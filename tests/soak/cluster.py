"""Two memsnapd nodes and a client, each in a network namespace of its own on one bridge (as
tests/e2e/test_move_ip.py builds them), sharing one store and one HMAC key (so --via-store works), with the
node token that lets them move jobs to each other. Real programs run as jobs on the nodes and are reached from
the client namespace at service addresses that move with them (--move-ip).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from pyroute2 import NetNS, netns

from tests.helpers import REPO, DaemonProc
from tests.netlab import bridge

SUBNET = "10.213.91"
PORT = 7443


def node_ip(host: int) -> str:
    return f"{SUBNET}.{host}"


@dataclass
class NodeDaemon(DaemonProc):
    """A memsnapd in a network namespace (a node), on the shared store."""

    netns: str = ""
    name: str = ""
    host: int = 0

    def args(self) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.netns}", *super().args()]

    @property
    def peer_address(self) -> str:
        return f"{node_ip(self.host)}:{PORT}"

    def restart(self, sig: int = signal.SIGTERM) -> None:
        """Stops the daemon (SIGTERM: graceful; SIGKILL: as a crash) and starts it again on the same dirs."""
        self.stop(sig)
        self.start(60)


@dataclass
class Cluster:
    """Nodes a and b, the client namespace c, all on a bridge in namespace sw."""

    base: Path
    a: NodeDaemon
    b: NodeDaemon
    c: str
    sw: str
    namespaces: list[str] = field(default_factory=list)

    @property
    def nodes(self) -> list[NodeDaemon]:
        return [self.a, self.b]

    def other(self, d: NodeDaemon) -> NodeDaemon:
        return self.b if d is self.a else self.a

    def in_client_ns(self, argv: list[str], **kw: object) -> subprocess.Popen[str]:
        """A process in the client's network namespace."""
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        return subprocess.Popen(["nsenter", f"--net=/run/netns/{self.c}", *argv], env=env, text=True,
                                **kw)  # type: ignore[call-overload]

    def add_service_ip(self, d: NodeDaemon, ip: str) -> None:
        """Puts a service address on node d (where its program starts)."""
        with NetNS(d.netns) as n:
            n.addr("add", index=n.link_lookup(ifname="eth0")[0], address=ip, prefixlen=24)

    def remove_service_ip(self, ip: str) -> None:
        """Takes a service address off whichever node holds it."""
        for d in self.nodes:
            with NetNS(d.netns) as n:
                try:
                    n.addr("del", index=n.link_lookup(ifname="eth0")[0], address=ip, prefixlen=24)
                except Exception:  # (not there)
                    pass

    def close(self) -> None:
        for d in self.nodes:
            d.cleanup()
        for ns in self.namespaces:
            try:
                netns.remove(ns)
            except OSError:
                pass


def build(base: Path) -> Cluster:
    """Builds the namespaces and starts both daemons (shared store, key and token)."""
    tag = secrets.token_hex(3)
    a, b, c, sw = (f"soak-{x}-{tag}" for x in ("a", "b", "c", "sw"))
    bridge(sw, [(a, node_ip(1)), (b, node_ip(2)), (c, node_ip(3))])
    made = [sw, a, b, c]
    base.mkdir(parents=True, exist_ok=True)
    token, key, store = base / "node.token", base / "hmac.key", base / "store"
    token.write_text(secrets.token_hex(32))
    key.write_bytes(secrets.token_bytes(32))
    for f in (token, key):
        os.chmod(f, 0o600)
    nodes = []
    for name, ns, host in (("node-a", a, 1), ("node-b", b, 2)):
        cfg = base / f"{name}.toml"
        cfg.write_text(f'[daemon]\nnode_name = "{name}"\nmove_commit_timeout_s = 30\n'
                       f'[security]\nhmac_key_file = "{key}"\n'
                       + "".join(f'[[peers]]\nname = "node-{x}"\naddress = "{node_ip(h)}:{PORT}"\n'
                                 for x, h in (("a", 1), ("b", 2))))
        d = NodeDaemon(base / name, netns=ns, name=name, host=host,
                       extra=["--config", str(cfg), "--listen", f"{node_ip(host)}:{PORT}",
                              "--auth-token-file", str(token), "--store-dir", str(store)])
        nodes.append(d)
    cluster = Cluster(base, nodes[0], nodes[1], c, sw, made)
    try:
        for d in cluster.nodes:
            d.start(60)
    except BaseException:
        cluster.close()
        raise
    return cluster
