"""Moves between two in-process nodes, as sequences: a source Mover streams to a target's real servicers
through the in-process peer transport (fake_peer.py), both nodes on FakeCriu. No root, no sockets.

After every step the nodes must be healthy: no checkpoint left dumping, no half-received image, no held
(stopped) copy, no mark of a move in flight, no restored process without its job; after a failed move the
job runs on at the source and nothing of it is left restorable on the target.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from fake_peer import Node, PeerNet
from fakes import FakeCriu, Procs, make_engine, procs_fixture, state_of  # noqa: F401

from memsnap import proc
from memsnap.client import ClientError, Target
from memsnap.criu import DumpOptions, DumpStats, NotifyCallback
from memsnap.engine import Caller
from memsnap.move.peer import PeerClient
from memsnap.move.plan import MoveRequest, MoveResult
from memsnap.move.tunnel import ask_verdict


class ImageCriu(FakeCriu):
    """FakeCriu with a bigger image (several 1 MiB chunks on the wire) that remembers what each dump wrote."""

    def __init__(self, pages: int = 0) -> None:
        super().__init__()
        self.lazy = False  # (no lazy-pages here: a target restores plainly, without early resume)
        self.pages = pages
        self.images: dict[str, dict[str, bytes]] = {}  # checkpoint id -> file -> bytes

    def dump(self, pid: int, images_dir: Path, work_dir: Path, opts: DumpOptions,
             notify: NotifyCallback | None = None) -> DumpStats:
        if self.pages:
            (images_dir / "pages-2.img").write_bytes(os.urandom(self.pages))
        stats = super().dump(pid, images_dir, work_dir, opts, notify)
        self.images[images_dir.name] = {p.name: p.read_bytes() for p in images_dir.iterdir()}
        return stats


@dataclass
class World:
    net: PeerNet
    a: Node
    b: Node
    procs: Procs
    caller: Caller

    def job(self) -> int:
        """A running job on node a (a `sleep`); its pid."""
        return self.procs.start()[0]

    def move(self, target: str, src: Node | None = None, dst: Node | None = None) -> MoveResult:
        """Moves target from src (a) to dst (b)."""
        src, dst = src or self.a, dst or self.b
        return src.mover.migrate(self.caller, MoveRequest(target=target, to=dst.name))


def _world(tmp: Path, procs: Procs, b_capacity: int = 0) -> World:
    net = PeerNet(tmp, ["node-a", "node-b"])
    nodes = []
    for name, capacity in (("node-a", 0), ("node-b", b_capacity)):
        (tmp / name).mkdir()
        engine = make_engine(tmp / name, capacity, criu=ImageCriu())
        nodes.append(net.add(name, engine, move_in_doubt_s=5.0))
    return World(net, nodes[0], nodes[1], procs, Caller(uid=os.getuid(), gid=os.getgid(), pid=os.getpid()))


@pytest.fixture
def own_pid_namespaces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every job is the init of a PID namespace of its own, as `memsnapctl run` makes it: both nodes share
    this host's pids, and the target would refuse a pid the stopped copy at the source still holds."""
    monkeypatch.setattr(proc, "in_own_pidns", lambda pid: True)


@pytest.fixture
def world(tmp_path: Path, procs: Procs, own_pid_namespaces: None) -> Iterator[World]:
    w = _world(tmp_path, procs)
    yield w
    _teardown(w)


def _teardown(w: World) -> None:
    for node in (w.a, w.b):
        for pid in _criu(node).restores:
            if proc.alive(pid):
                proc.kill_tree(pid)
        node.engine.catalog.close()


def _criu(node: Node) -> ImageCriu:
    criu = node.engine.criu
    assert isinstance(criu, ImageCriu)
    return criu


# -- the transport itself -----------------------------------------------------------------------------------
def _to_b(w: World, token: str = "") -> tuple[PeerClient, str]:
    """A PeerClient from a to b as a's Mover makes it (a's credential for b, or the token given)."""
    client, good = w.a.mover._target_client(MoveRequest(target="", to="node-b"), w.caller)
    return (w.net.dial(Target(address=w.b.address, token=token)) if token else client), good


def test_an_abort_on_the_target_reaches_the_source_as_the_client_error_grpc_gives(world: World) -> None:
    with _to_b(world)[0] as client:
        with pytest.raises(ClientError) as err:
            client.commit_move("ck-nothing-moved")
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "no job moved from" in err.value.message
        with pytest.raises(ClientError) as err:
            client.client.checkpoint("1")  # a peer may only move jobs (auth.AuthInterceptor)
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
    with _to_b(world, token="x" * 32)[0] as stranger, pytest.raises(ClientError) as err:
        stranger.status()
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    with world.net.dial(Target(address="node-c:7070", token="x" * 32)) as nowhere, \
            pytest.raises(ClientError) as err:
        nowhere.jobs()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and "not reachable" in err.value.message


def test_a_fault_fails_just_the_nth_call(world: World) -> None:
    world.net.fail("ListJobs", grpc.StatusCode.DEADLINE_EXCEEDED, nth=2)
    with _to_b(world)[0] as client:
        assert client.jobs() == []
        with pytest.raises(ClientError) as err:
            client.jobs()
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert client.jobs() == []
    assert world.net.calls == ["ListJobs"] * 3


def test_the_page_tunnel_carries_a_sealed_verdict_both_ways(world: World) -> None:
    client, token = _to_b(world)
    with client:
        verdict = ask_verdict(client, "0" * 32, token)
    assert verdict is not None and not verdict[0]  # (b ran no lazy move through that tunnel)
    assert world.net.calls == ["PageTunnel"]
