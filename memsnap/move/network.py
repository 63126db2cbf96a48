"""The IP move: an address (and the TCP connections on it) leaves the source and comes up on the target.

    source                                          target
    ConnectionLock: nft drops the connections'
      packets while CRIU dumps them (repair mode)
    post-dump: remove the address  ---------------> IncomingAddress: lock, add the address
                                                    restore; post-restore: unlock (sockets exist)
                                                    announce it (gratuitous ARP / unsolicited NA)
    rollback: give the address back, unlock
"""

from __future__ import annotations

import logging

from memsnap import net
from memsnap.criu import NotifyCallback, NotifyHandlers
from memsnap.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger("memsnap.move")


def parse_moved_ip(move_ip: str) -> net.IfAddr | None:
    """--move-ip ADDR/PREFIX, which must be configured on this node (None when not asked)."""
    if not move_ip:
        return None
    try:
        ifa = net.parse_interface(move_ip)
    except ValueError as exc:
        raise InvalidArgument(f"--move-ip: {exc}") from exc
    if not net.holder_of(ifa):
        raise InvalidArgument(f"--move-ip: {ifa.ip} is not configured on this node")
    return ifa


def require_nft() -> None:
    """--tcp-established locks the connections with nft during the move."""
    if not net.nft_available():
        raise FailedPrecondition("--tcp-established needs nft (apt-get install nftables) to lock the "
                                 "connections during the move")


def source_lock(pid: int, moved_ip: net.IfAddr | None) -> net.ConnectionLock:
    """A lock on the moved address, or on the tree's own connections when no address moves."""
    addrs = [str(moved_ip.ip)] if moved_ip else []
    conns = [] if moved_ip else net.tcp_connections(pid)
    return net.ConnectionLock(addresses=addrs, conns=conns)


def remove_stale_locks() -> list[str]:
    """Drops the network locks a killed memsnapd left (they would drop the moved addresses' traffic)."""
    return list(net.remove_stale_locks())


def unlock_after_restore(lock: net.ConnectionLock | None) -> NotifyCallback:
    """A CRIU notify callback: post-restore, the sockets exist again (still in repair mode), so packets
    find them now and the lock may go."""

    def restored(_pid: int) -> None:
        if lock is not None:
            lock.release()

    return NotifyHandlers(post_restore=restored)


class IncomingAddress:
    """The target's half: lock the address's connections, add it before the restore, announce it after;
    undo both if the restore fails."""

    def __init__(self, add_ip: str, dev: str, tcp_established: bool) -> None:
        self.ifa: net.IfAddr | None = None
        if add_ip:
            try:
                self.ifa = net.parse_interface(add_ip)
            except ValueError as exc:
                raise InvalidArgument(f"add_ip: {exc}") from exc
        self.dev = dev
        self.lock = net.ConnectionLock(addresses=[str(self.ifa.ip)]) if self.ifa and tcp_established else None
        self.added = ""

    def bring_up(self) -> None:
        """Locks, then adds the address (FailedPrecondition when the node refuses)."""
        try:
            if self.lock is not None:
                self.lock.acquire()
            if self.ifa is not None:
                self.added = net.add_address(self.ifa, self.dev)
        except net.NetError as exc:
            raise FailedPrecondition(str(exc)) from exc

    def notify(self) -> NotifyCallback | None:
        """The restore's notify callback (only when connections are locked)."""
        return unlock_after_restore(self.lock) if self.lock is not None else None

    def failed(self) -> None:
        """The restore failed: unlock, and take the address off again."""
        if self.lock is not None:
            self.lock.release()
        if self.added and self.ifa is not None:
            try:
                net.remove_address(self.ifa, self.added)
            except net.NetError as exc:
                log.error("could not remove %s after a failed restore: %s", self.ifa, exc)

    def done(self) -> None:
        """The job runs here: unlock and announce the address."""
        if self.lock is not None:
            self.lock.release()
        if self.ifa is not None:
            net.announce(self.ifa, self.added)
