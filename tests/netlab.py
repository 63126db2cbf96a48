"""Network namespaces joined by a bridge: the "nodes" of the move and soak tests (never the host's network)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pyroute2 import NetNS, netns

from tests.helpers import DaemonProc


@dataclass
class NsDaemon(DaemonProc):
    """A memsnapd that runs inside a network namespace (a 'node')."""

    netns: str = ""

    def args(self) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.netns}", *super().args()]


def node_args(subnet: str, host: int, token: Path) -> list[str]:
    """memsnapd's flags for node `host` of a LAN subnet.0/24 (its address subnet.host): it listens there, and
    nodes 1 and 2 are its peers (jobs move only to peers); token is the cluster's node token."""
    os.chmod(token, 0o600)
    cfg = token.parent / f"node-{host}.toml"
    cfg.write_text(f'[daemon]\nnode_name = "node-{host}"\n' + "".join(
        f'[[peers]]\nname = "node-{h}"\naddress = "{subnet}.{h}:7443"\n' for h in (1, 2)))
    return ["--config", str(cfg), "--listen", f"{subnet}.{host}:7443", "--auth-token-file", str(token)]


def bridge(switch: str, hosts: list[tuple[str, str]]) -> None:
    """Creates namespace `switch` with a bridge, and each (namespace, address) in `hosts` with an eth0 on it holding
    that address (/24) as its first one, and lo up. Every namespace is created here; on failure they are gone."""
    made: list[str] = []
    try:
        for ns in (switch, *(ns for ns, _ in hosts)):
            netns.create(ns)
            made.append(ns)
        with NetNS(switch) as sw:
            sw.link("add", ifname="br0", kind="bridge")
            br = sw.link_lookup(ifname="br0")[0]
            for i, (ns, address) in enumerate(hosts, 1):
                port, peer = f"p{i}", f"e{i}"
                sw.link("add", ifname=port, kind="veth", peer=peer)
                sw.link("set", index=sw.link_lookup(ifname=port)[0], master=br, state="up")
                sw.link("set", index=sw.link_lookup(ifname=peer)[0], net_ns_fd=ns)
                with NetNS(ns) as n:
                    idx = n.link_lookup(ifname=peer)[0]
                    n.link("set", index=idx, ifname="eth0")
                    n.link("set", index=idx, state="up")
                    n.link("set", index=n.link_lookup(ifname="lo")[0], state="up")
                    # The node's own address first: a service address is then a secondary one.
                    n.addr("add", index=idx, address=address, prefixlen=24)
            sw.link("set", index=br, state="up")
    except BaseException:
        for ns in made:
            netns.remove(ns)
        raise
