"""Network identity for moves: service addresses (pyroute2), gratuitous ARP, and TCP connection locks (nft).

A move with --tcp-established keeps the job's connections: while the job is frozen on the source and
until its sockets exist again on the target, no packet of those connections may reach a kernel that
has no socket for them (it would answer with a RST). memsnap holds that lock itself, with one nftables
table per move on each node, and tells CRIU to skip its own locking: the same lock then works on both
sides of the move and with CRIU builds that lack libnftables.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import secrets
import shutil
import socket
import struct
import subprocess
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    from pyroute2 import IPRoute

log = logging.getLogger("memsnap.net")

# libsoccr marks the packets it sends itself while restoring a socket; CRIU's own lock lets them pass too.
_SOCCR_MARK = 0xC114
IfAddr = ipaddress.IPv4Interface | ipaddress.IPv6Interface


class NetError(Exception):
    """An address or lock operation failed; the message says which and why."""


def parse_interface(text: str) -> IfAddr:
    """'10.0.0.5/24' -> an interface address; the prefix is required."""
    if "/" not in text:
        raise ValueError(f"{text!r} has no prefix length; write ADDR/PREFIX such as 10.0.0.5/24")
    return ipaddress.ip_interface(text.strip())


def _family(ifa: IfAddr) -> int:
    return socket.AF_INET if ifa.version == 4 else socket.AF_INET6


def _iproute() -> IPRoute:
    """A netlink socket (pyroute2 imported here: it is an eighth of memsnapd's start, and only moves that carry
    an address use it)."""
    from pyroute2 import IPRoute

    return IPRoute()


def _index(ipr: IPRoute, dev: str) -> int:
    found = ipr.link_lookup(ifname=dev)
    if not found:
        raise NetError(f"no network device {dev!r} on this node")
    return int(found[0])


def _ifname(ipr: IPRoute, index: int) -> str:
    return str(ipr.link("get", index=index)[0].get_attr("IFLA_IFNAME"))


def holder_of(ifa: IfAddr) -> str:
    """The device that holds the address here, or '' when none does."""
    with _iproute() as ipr:
        for a in ipr.get_addr(family=_family(ifa)):
            if a.get_attr("IFA_ADDRESS") == str(ifa.ip):
                return _ifname(ipr, int(a["index"]))
    return ""


def device_for(ifa: IfAddr) -> str:
    """The device whose own addresses share the subnet of ifa (where a moved address belongs)."""
    with _iproute() as ipr:
        for a in ipr.get_addr(family=_family(ifa)):
            mine = ipaddress.ip_interface(f"{a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}")
            if mine.ip != ifa.ip and ifa.ip in mine.network:
                return _ifname(ipr, int(a["index"]))
    raise NetError(f"no device here has an address in {ifa.network}; pass the device to use for {ifa}")


def remove_address(ifa: IfAddr, dev: str = "") -> str:
    """Removes the address from this node; returns the device it was on."""
    dev = dev or holder_of(ifa)
    if not dev:
        raise NetError(f"{ifa.ip} is not configured on this node")
    with _iproute() as ipr:
        try:
            ipr.addr("del", index=_index(ipr, dev), address=str(ifa.ip), prefixlen=ifa.network.prefixlen)
        except Exception as exc:  # pyroute2's NetlinkError
            raise NetError(f"cannot remove {ifa} from {dev}: {exc}") from exc
    log.info("removed %s from %s", ifa, dev)
    return dev


def add_address(ifa: IfAddr, dev: str = "") -> str:
    """Adds the address here (on dev, else on the device of its subnet), then announces it; returns dev."""
    dev = dev or device_for(ifa)
    with _iproute() as ipr:
        index = _index(ipr, dev)
        kw: dict[str, object] = {}
        if ifa.version == 6:
            kw["flags"] = 0x02  # IFA_F_NODAD: the address just left the other node, nobody else has it
        try:
            ipr.addr("add", index=index, address=str(ifa.ip), prefixlen=ifa.network.prefixlen, **kw)
        except Exception as exc:
            raise NetError(f"cannot add {ifa} to {dev}: {exc}") from exc
    log.info("added %s to %s", ifa, dev)
    announce(ifa, dev)
    return dev


def announce(ifa: IfAddr, dev: str) -> None:
    """Gratuitous ARP for an IPv4 address, so neighbours send to this node's MAC at once."""
    if ifa.version != 4:
        return  # IPv6 neighbours re-resolve on their own (NUD); unsolicited NA is not implemented
    with _iproute() as ipr:
        mac_text = ipr.link("get", index=_index(ipr, dev))[0].get_attr("IFLA_ADDRESS")
    mac = bytes.fromhex(str(mac_text).replace(":", ""))
    ip = ifa.ip.packed
    frame = (b"\xff" * 6 + mac + struct.pack("!H", 0x0806)
             + struct.pack("!HHBBH", 1, 0x0800, 6, 4, 1) + mac + ip + b"\x00" * 6 + ip)
    try:
        with socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0806)) as s:
            s.bind((dev, 0x0806))
            for _ in range(2):
                s.send(frame)
    except OSError as exc:  # announcing is an optimisation: neighbours re-resolve eventually
        log.warning("gratuitous ARP for %s on %s failed: %s", ifa.ip, dev, exc)


@dataclass(frozen=True)
class Conn:
    """One TCP connection as seen from the node that holds it."""

    local: str
    lport: int
    remote: str
    rport: int


def tcp_connections(pid: int) -> list[Conn]:
    """Established TCP connections of a process tree (from /proc, in the tree's own netns)."""
    out: list[Conn] = []
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return out
    for p in procs:
        try:
            conns = p.net_connections(kind="tcp")
        except psutil.Error:
            continue
        for c in conns:
            if c.status == psutil.CONN_ESTABLISHED and c.raddr:
                out.append(Conn(c.laddr.ip, c.laddr.port, c.raddr.ip, c.raddr.port))
    return sorted(set(out), key=lambda c: (c.local, c.lport, c.remote, c.rport))


def _ipkw(addr: str) -> str:
    return "ip6" if ipaddress.ip_address(addr).version == 6 else "ip"


@dataclass
class ConnectionLock:
    """An nftables table that drops TCP to/from some addresses and connections until released."""

    addresses: list[str] = field(default_factory=list)
    conns: list[Conn] = field(default_factory=list)
    table: str = field(default_factory=lambda: "memsnap_lock_" + secrets.token_hex(4))
    held: bool = False

    def ruleset(self) -> str:
        """The table as an nft script."""
        inp = [f"meta mark {_SOCCR_MARK:#x} accept"]
        out = [f"meta mark {_SOCCR_MARK:#x} accept"]
        for a in self.addresses:
            k = _ipkw(a)
            inp.append(f"{k} daddr {a} meta l4proto tcp drop")
            out.append(f"{k} saddr {a} meta l4proto tcp drop")
        for c in self.conns:
            k = _ipkw(c.local)
            inp.append(f"{k} saddr {c.remote} {k} daddr {c.local} tcp sport {c.rport} tcp dport {c.lport} "
                       "drop")
            out.append(f"{k} saddr {c.local} {k} daddr {c.remote} tcp sport {c.lport} tcp dport {c.rport} "
                       "drop")
        # Priority raw (-300): before conntrack, so locked packets leave no state behind.
        chains = [f" chain {name} {{ type filter hook {name} priority -300; policy accept;\n"
                  + "".join(f"  {r}\n" for r in rules) + " }\n"
                  for name, rules in (("input", inp), ("output", out))]
        return f"table inet {self.table} {{\n" + "".join(chains) + "}\n"

    def acquire(self) -> ConnectionLock:
        """Installs the table; raises NetError when nft is missing or refuses."""
        _nft(self.ruleset(), f"lock {', '.join(self.addresses) or 'connections'}")
        self.held = True
        log.info("network lock %s: %d addresses, %d connections", self.table, len(self.addresses),
                 len(self.conns))
        return self

    def release(self) -> None:
        """Removes the table (idempotent; failures are logged, since nothing else can be done)."""
        if not self.held:
            return
        try:
            _nft(f"delete table inet {self.table}\n", "unlock")
            self.held = False
        except NetError as exc:
            log.error("could not remove network lock %s: %s", self.table, exc)


def remove_stale_locks() -> list[str]:
    """Deletes the lock tables that a memsnapd killed mid-move left behind; returns their names.

    Called at start, when no move of this daemon is in flight: a leftover table would drop the moved
    address's TCP traffic on this node for good.
    """
    binary = shutil.which("nft")
    if binary is None:
        return []
    r = subprocess.run([binary, "list", "tables", "inet"], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        log.warning("cannot list nftables tables to look for stale network locks: %s", r.stderr.strip())
        return []
    removed = []
    for line in r.stdout.splitlines():
        name = line.split()[-1] if line.startswith("table inet ") else ""
        if _LOCK_TABLE.match(name):
            try:
                _nft(f"delete table inet {name}\n", f"remove the stale lock {name}")
                removed.append(name)
            except NetError as exc:
                log.error("%s", exc)
    return removed


_LOCK_TABLE = re.compile(r"^memsnap_lock_[0-9a-f]{8}$")


def nft_available() -> bool:
    """Whether the nft tool is installed (package nftables)."""
    return shutil.which("nft") is not None


def _nft(script: str, what: str) -> None:
    binary = shutil.which("nft")
    if binary is None:
        raise NetError("nft is not installed (apt-get install nftables); it is needed to keep TCP "
                       "connections across a move")
    r = subprocess.run([binary, "-f", "-"], input=script, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        lines = r.stderr.strip().splitlines()
        raise NetError(f"nft could not {what}: {lines[-1] if lines else f'exit status {r.returncode}'}")
