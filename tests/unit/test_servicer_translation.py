"""The servicers' translation, without a daemon: what the engine raises becomes the right gRPC code and one line,
anything else is INTERNAL (a bug, logged), and the caller is who the relay's peer name says."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from memsnap import errors
from memsnap.api import MemsnapServicer
from memsnap.caller import Caller
from memsnap.catalog import CheckpointRecord, now_ms
from memsnap.lifecycle import IllegalTransition
from memsnap.v1 import memsnap_pb2 as pb


class Aborted(Exception):
    pass


class FakeContext:
    """What a servicer uses of grpc.ServicerContext."""

    def __init__(self, peer: str = "unix-abstract:memsnap-peer/1000/1000/4242/x", active: bool = True) -> None:
        self._peer = peer
        self.active = active
        self.status: grpc.StatusCode | None = None
        self.details = ""

    def peer(self) -> str:
        return self._peer

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.status, self.details = code, details
        raise Aborted(details)

    def code(self) -> grpc.StatusCode | None:
        return self.status

    def is_active(self) -> bool:
        return self.active


class FakeEngine:
    node = "node-a"

    def __init__(self, raises: BaseException | None = None) -> None:
        self.raises = raises
        self.callers: list[Caller] = []

    def get(self, caller: Caller, ckpt_id: str) -> CheckpointRecord:
        self.callers.append(caller)
        if self.raises is not None:
            raise self.raises
        return CheckpointRecord(id=ckpt_id, state="durable", pid=7, owner_uid=caller.uid, created_ms=now_ms())


def call(engine: FakeEngine, ctx: FakeContext | None = None) -> tuple[Any, FakeContext]:
    ctx = ctx or FakeContext()
    try:
        return MemsnapServicer(engine).GetCheckpoint(pb.GetCheckpointRequest(id="ck-1"), ctx), ctx  # type: ignore[arg-type]
    except Aborted:
        return None, ctx


@pytest.mark.parametrize("exc", [errors.NotFound, errors.InvalidArgument, errors.TierExhausted, errors.QuotaExceeded,
                                 errors.FailedPrecondition, errors.PermissionDenied, errors.Unauthenticated,
                                 errors.Unavailable, errors.IntegrityFailure, errors.Aborted])
def test_an_engine_error_becomes_its_code_and_one_line(exc: type[errors.MemsnapError]) -> None:
    _, ctx = call(FakeEngine(exc("checkpoint ck-1: no\nsuch thing; 'memsnapctl list' shows them")))
    assert ctx.status == getattr(grpc.StatusCode, exc.code) and ctx.status != grpc.StatusCode.INTERNAL
    assert ctx.details == "checkpoint ck-1: no such thing; 'memsnapctl list' shows them"


@pytest.mark.parametrize("exc", [RuntimeError("boom"), IllegalTransition("checkpoint ck-1 is durable: it cannot "
                                                                            "become failed"), KeyError("x")])
def test_anything_else_is_internal_and_says_where_to_look(exc: BaseException, caplog: pytest.LogCaptureFixture) -> None:
    _, ctx = call(FakeEngine(exc))
    assert ctx.status == grpc.StatusCode.INTERNAL
    assert ctx.details.startswith("internal error: ") and ctx.details.endswith("see the memsnapd log")
    assert "internal error in GetCheckpoint" in caplog.text  # (logged with its traceback: it is a bug)


def test_the_caller_is_the_uid_the_relay_named_and_nobody_without_one() -> None:
    eng = FakeEngine()
    got, _ = call(eng)
    assert got.checkpoint.id == "ck-1" and eng.callers == [Caller(1000, 1000, 4242)]
    _, ctx = call(FakeEngine(), FakeContext(peer="ipv4:10.0.0.9:5555"))  # (TCP, not authenticated by auth.py)
    assert ctx.status == grpc.StatusCode.UNAUTHENTICATED


def test_a_bad_checkpoint_id_is_refused_before_the_engine_is_asked() -> None:
    eng = FakeEngine()
    ctx = FakeContext()
    with pytest.raises(Aborted):
        MemsnapServicer(eng).GetCheckpoint(pb.GetCheckpointRequest(id="../../etc"), ctx)  # type: ignore[arg-type]
    assert ctx.status == grpc.StatusCode.INVALID_ARGUMENT and eng.callers == []


class _Gone(grpc.RpcError):
    """What a client stream's request iterator raises in the handler once its caller cancelled."""


def test_a_request_stream_whose_caller_went_away_ends_quietly_not_internal(caplog: pytest.LogCaptureFixture) -> None:
    _, ctx = call(FakeEngine(_Gone()), FakeContext(active=False))
    assert ctx.status is None
    assert "internal error" not in caplog.text


def test_an_rpc_error_while_the_caller_still_waits_is_internal(caplog: pytest.LogCaptureFixture) -> None:
    _, ctx = call(FakeEngine(_Gone()))
    assert ctx.status == grpc.StatusCode.INTERNAL and "internal error in GetCheckpoint" in caplog.text


class FakeCollector:
    def __init__(self) -> None:
        self.runs: list[tuple[Caller, bool]] = []

    def run(self, caller: Caller, dry_run: bool = False) -> Any:
        from memsnap.gc import GcReport
        self.runs.append((caller, dry_run))
        return GcReport(dry_run=dry_run, kept={"ck-1": "newest"})


def test_gc_runs_on_the_collector_the_servicer_is_given_and_is_refused_without_one() -> None:
    gc = FakeCollector()
    got = MemsnapServicer(FakeEngine(), gc=gc).Gc(pb.GcRequest(dry_run=True), FakeContext())  # type: ignore[arg-type]
    assert gc.runs == [(Caller(1000, 1000, 4242), True)] and [k.id for k in got.kept] == ["ck-1"]
    ctx = FakeContext()
    with pytest.raises(Aborted):
        MemsnapServicer(FakeEngine()).Gc(pb.GcRequest(), ctx)  # type: ignore[arg-type]
    assert ctx.status == grpc.StatusCode.FAILED_PRECONDITION and "no garbage collector" in ctx.details
