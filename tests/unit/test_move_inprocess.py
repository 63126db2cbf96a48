"""Moves between two in-process nodes, as sequences: a source Mover streams to a target's real servicers
through the in-process peer transport (fake_peer.py), both nodes on FakeCriu. No root, no sockets.

After every step the nodes must be healthy: no checkpoint left dumping, no half-received image, no held
(stopped) copy, no mark of a move in flight, no restored process without its job; after a failed move the
job runs on at the source and nothing of it is left restorable on the target.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from fake_peer import Node, PeerNet
from fakes import FakeCriu, Procs, make_engine, procs_fixture, state_of  # noqa: F401

from memsnap import manifest, proc
from memsnap.catalog import DUMPING, STAGED
from memsnap.client import ClientError, Target
from memsnap.criu import DumpOptions, DumpStats, NotifyCallback
from memsnap.engine import Caller
from memsnap.errors import MemsnapError, TierExhausted
from memsnap.move.peer import PeerClient
from memsnap.move.plan import MoveRequest, MoveResult
from memsnap.move.tunnel import ask_verdict

MIB = 1 << 20
MOVE_MARKS = ("hold", "committing_to", "move_pending", "move_incoming")


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


# -- node health ------------------------------------------------------------------------------------------
def assert_healthy(w: World) -> None:
    """Both nodes, once every call's handler returned: no transient state, no move in flight, no stray
    process (every process FakeCriu restored is a running job's, or gone), nothing left stopped."""
    w.net.settle()
    for p in w.procs.started:
        assert state_of(p.pid) != "T", f"pid {p.pid} is left stopped"
    for node in (w.a, w.b):
        e = node.engine
        assert list(e.tier.staging_ids()) == [], f"{node.name}: a half-written or half-received image"
        for rec in e.catalog.checkpoints():
            assert rec.state != DUMPING, f"{node.name}: {rec.id} stuck dumping"
            left = [k for k in MOVE_MARKS if rec.meta.get(k)]
            assert not left, f"{node.name}: {rec.id} still marked {left}"
        running = {j.pid for j in e.catalog.jobs() if not j.ended and proc.alive(j.pid, j.pid_start)}
        for pid in _criu(node).restores:
            assert pid in running or not proc.alive(pid), f"{node.name}: restored pid {pid} runs without a job"
            assert state_of(pid) != "T", f"{node.name}: restored pid {pid} is left stopped"
        assert node.mover.moves_in_doubt() == []


def assert_rolled_back(w: World, pid: int) -> None:
    """A failed move: the job runs on at the source (not stopped), and neither node keeps an image of it."""
    assert state_of(pid) in ("S", "R"), f"the source's job is {state_of(pid)!r}, not running"
    for node in (w.a, w.b):
        assert node.engine.catalog.checkpoints() == [], f"{node.name} kept a checkpoint of a move that failed"
        assert node.engine.tier.published_ids() == [], f"{node.name} kept an image of a move that failed"
    assert [j for j in w.b.engine.catalog.jobs() if not j.ended] == []
    assert_healthy(w)


def assert_moved(w: World, pid: int, res: MoveResult, src: Node, dst: Node) -> None:
    """A committed move: the source's copy ended and its image dropped; the target runs the job from a
    verified, re-signed copy of exactly the bytes dumped."""
    assert state_of(pid) in ("", "Z"), "the source's stopped copy still exists"
    assert not src.engine.tier.has(res.checkpoint_id) and src.engine.catalog.get_checkpoint(res.checkpoint_id) is None
    job = dst.engine.catalog.get_job(res.target_job)
    assert job is not None and not job.ended and proc.alive(job.pid, job.pid_start) and job.pid == res.target_pid
    assert job.restored_from == res.checkpoint_id and job.moved_from.startswith(f"{src.engine.hostname}/")
    rec = dst.engine.catalog.get_checkpoint(res.checkpoint_id)
    assert rec is not None and rec.state == STAGED and rec.in_tier
    path = dst.engine.tier.path(res.checkpoint_id)
    manifest.verify_dir(path, dst.engine.key)  # (signed with the target's own key, every file intact)
    sent = _criu(src).images[res.checkpoint_id]
    assert {f: (path / f).read_bytes() for f in sent} == sent
    dst.timers.run_out()  # the commit came in time: its timers change nothing
    assert proc.alive(job.pid, job.pid_start) and dst.engine.tier.has(res.checkpoint_id)
    assert_healthy(w)


# -- sequences --------------------------------------------------------------------------------------------
def test_a_move_commits_and_the_target_runs_the_job_from_a_verified_copy(world: World,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    _criu(world.a).pages = 3 * MIB
    journaled: list[dict[str, object]] = []
    merge = world.a.engine.catalog.merge_meta

    def journal(ckpt_id: str, changes: dict[str, Any]) -> bool:
        journaled.append(dict(changes))
        return merge(ckpt_id, changes)

    monkeypatch.setattr(world.a.engine.catalog, "merge_meta", journal)
    pid = world.job()
    res = world.move(str(pid))
    assert world.net.calls == ["Status", "ReceiveImage", "RestoreReceived", "ListJobs", "CommitMove"]
    # the source journaled the move as done (then dropped its image: the target's copy is the job's now)
    assert any(m.get("moved_to") == "node-b" and m.get("moved_job") == res.target_job for m in journaled)
    assert res.bytes_sent > 3 * MIB and [n for n, _ in res.phases][:2] == ["preflight", "dump"]
    assert_moved(world, pid, res, world.a, world.b)


@pytest.mark.parametrize("after", [1, 4], ids=["after-the-header", "mid-file"])
def test_a_stream_cut_half_way_rolls_back_and_the_target_keeps_nothing(world: World, after: int) -> None:
    _criu(world.a).pages = 3 * MIB
    pid = world.job()
    world.net.cut("ReceiveImage", after=after)
    with pytest.raises(MemsnapError, match="failed at transfer.*UNAVAILABLE.*resumed on this node") as err:
        world.move(str(pid))
    assert err.value.code == "UNAVAILABLE"
    assert "RestoreReceived" not in world.net.calls
    assert_rolled_back(world, pid)
    # the source's request stream ended too (gRPC's sender thread is not held by a move that failed)
    deadline = time.monotonic() + 3
    while any(t.name == "send-requests" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [t.name for t in threading.enumerate() if t.name == "send-requests"]


def test_a_target_without_room_refuses_at_preflight_and_the_job_is_not_touched(tmp_path: Path,
                                                                               procs: Procs) -> None:
    w = _world(tmp_path, procs, b_capacity=8 * MIB)  # (a move needs the job's size plus 16 MiB of slack)
    try:
        pid = w.job()
        with pytest.raises(TierExhausted, match="failed at preflight.*not touched"):
            w.move(str(pid))
        assert w.net.calls == ["Status"] and _criu(w.a).dumps == []
        assert_rolled_back(w, pid)
    finally:
        _teardown(w)


def test_an_unreachable_target_fails_the_preflight_and_the_job_is_not_touched(world: World) -> None:
    pid = world.job()
    world.net.fail("Status", grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(MemsnapError, match="failed at preflight.*UNAVAILABLE.*not touched"):
        world.move(str(pid))
    assert world.net.calls == ["Status"] and _criu(world.a).dumps == []
    assert_rolled_back(world, pid)


def test_an_image_whose_receipt_is_lost_rolls_back_and_goes_with_its_timer(world: World) -> None:
    pid = world.job()
    world.net.fail("ReceiveImage", grpc.StatusCode.UNAVAILABLE, lose_reply=True)  # received, verified, unanswered
    with pytest.raises(MemsnapError, match="failed at transfer.*UNAVAILABLE"):
        world.move(str(pid))
    [rec] = world.b.engine.catalog.checkpoints()
    assert rec.meta.get("move_incoming") and world.b.engine.tier.has(rec.id)
    world.b.timers.run_out()  # no restore asked for it in time
    assert_rolled_back(world, pid)


def test_a_refused_commit_rolls_back_and_the_targets_copy_dies_with_its_timer(world: World) -> None:
    pid = world.job()
    world.net.fail("CommitMove", grpc.StatusCode.FAILED_PRECONDITION)  # (the image arrived and was restored)
    with pytest.raises(MemsnapError, match="failed at commit.*FAILED_PRECONDITION.*resumed on this node"):
        world.move(str(pid))
    assert world.net.calls[-2:] == ["ListJobs", "CommitMove"]
    assert state_of(pid) in ("S", "R")
    [restored] = _criu(world.b).restores
    assert proc.alive(restored)  # the target heard nothing: its copy waits for a commit
    world.b.timers.run_out()  # ... until the commit timeout
    assert not proc.alive(restored)
    assert_rolled_back(world, pid)


def test_a_refused_restore_rolls_back_and_the_received_image_goes_with_its_timer(world: World) -> None:
    pid = world.job()
    world.net.fail("RestoreReceived", grpc.StatusCode.RESOURCE_EXHAUSTED)
    with pytest.raises(MemsnapError, match="failed at restore on the target.*RESOURCE_EXHAUSTED"):
        world.move(str(pid))
    [rec] = world.b.engine.catalog.checkpoints()  # received and verified, never restored
    assert rec.meta.get("move_incoming") and _criu(world.b).restores == []
    world.b.timers.run_out()
    assert_rolled_back(world, pid)


def test_a_restore_whose_reply_is_lost_is_found_running_and_the_move_goes_on(world: World) -> None:
    pid = world.job()
    world.net.fail("RestoreReceived", grpc.StatusCode.UNAVAILABLE, lose_reply=True)
    res = world.move(str(pid))
    assert world.net.calls.count("ListJobs") == 2  # asked what runs there, then confirmed
    assert_moved(world, pid, res, world.a, world.b)


def test_a_commit_whose_reply_is_lost_is_asked_again_and_the_move_holds(world: World) -> None:
    pid = world.job()
    world.net.fail("CommitMove", grpc.StatusCode.UNAVAILABLE, lose_reply=True)  # applied there, unanswered
    res = world.move(str(pid))
    assert world.net.calls.count("CommitMove") == 2
    assert_moved(world, pid, res, world.a, world.b)


def test_a_job_moves_there_and_back(world: World) -> None:
    pid = world.job()
    there = world.move(str(pid))
    assert_moved(world, pid, there, world.a, world.b)
    back = world.move(there.target_job, src=world.b, dst=world.a)
    assert back.checkpoint_id != there.checkpoint_id
    assert_moved(world, there.target_pid, back, world.b, world.a)
    job_b = world.b.engine.catalog.get_job(there.target_job)
    assert job_b is not None and job_b.ended
    # b keeps the image it got first (the job's checkpoint there); the one it sent back is gone
    assert world.b.engine.tier.published_ids() == [there.checkpoint_id]


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
