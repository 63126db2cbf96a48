"""A checkpoint's life (memsnap.lifecycle): the legal next states, the one writer of them, and its waiters."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest

from memsnap import lifecycle
from memsnap.catalog import DRAINING, DUMPING, DURABLE, FAILED, STAGED, STATES, Catalog, CheckpointRecord, now_ms
from memsnap.lifecycle import IllegalTransition

PKG = Path(__file__).resolve().parents[2] / "memsnap"
LEGAL = {(DUMPING, STAGED), (DUMPING, FAILED), (STAGED, DRAINING), (STAGED, FAILED), (DRAINING, DRAINING),
         (DRAINING, STAGED), (DRAINING, DURABLE), (DRAINING, FAILED)}


@pytest.fixture
def catalog(tmp_path: Path) -> Catalog:
    return Catalog(tmp_path)


def new(catalog: Catalog, state: str = DUMPING, ckpt_id: str = "ck-1") -> str:
    catalog.add_checkpoint(CheckpointRecord(id=ckpt_id, state=state, pid=1, owner_uid=0, created_ms=now_ms()))
    return ckpt_id


@pytest.mark.parametrize("src", STATES)
@pytest.mark.parametrize("dst", STATES)
def test_a_checkpoint_enters_only_the_states_its_state_may_be_followed_by(catalog: Catalog, src: str,
                                                                            dst: str) -> None:
    ck = new(catalog, src)
    if (src, dst) in LEGAL:
        assert lifecycle.advance(catalog, ck, dst, last_error="why")
        rec = catalog.get_checkpoint(ck)
        assert rec is not None and rec.state == dst and rec.last_error == "why"
    else:
        with pytest.raises(IllegalTransition, match=f"is {src}: it cannot become {dst}"):
            lifecycle.advance(catalog, ck, dst, last_error="why")
        rec = catalog.get_checkpoint(ck)
        assert rec is not None and rec.state == src and rec.last_error == ""  # (nothing of the change was kept)


def test_a_checkpoint_deleted_meanwhile_advances_nowhere_and_that_is_no_error(catalog: Catalog) -> None:
    ck = new(catalog, STAGED)
    lifecycle.forget(catalog, ck)
    assert lifecycle.advance(catalog, ck, DRAINING) is False
    assert catalog.get_checkpoint(ck) is None


def test_a_checkpoint_is_born_dumping_or_durable_only(catalog: Catalog) -> None:
    for i, state in enumerate((DUMPING, DURABLE)):
        lifecycle.begin(catalog, CheckpointRecord(id=f"ck-ok{i}", state=state, pid=1, owner_uid=0,
                                                  created_ms=now_ms()))
    for state in (STAGED, DRAINING, FAILED):
        with pytest.raises(IllegalTransition, match=f"cannot enter the catalog as {state}"):
            lifecycle.begin(catalog, CheckpointRecord(id=f"ck-{state}", state=state, pid=1, owner_uid=0,
                                                      created_ms=now_ms()))
        assert catalog.get_checkpoint(f"ck-{state}") is None


def test_a_settled_checkpoint_is_not_rewritten_by_a_late_writer(catalog: Catalog) -> None:
    """Recovery marking a lost tier copy FAILED after the drain made it DURABLE (or the other way round): the
    second writer loses loudly, and the record keeps what the first wrote."""
    ck = new(catalog, DRAINING)
    assert lifecycle.advance(catalog, ck, DURABLE, in_store=True)
    with pytest.raises(IllegalTransition):
        lifecycle.advance(catalog, ck, FAILED, last_error="tier copy lost before it became durable")
    rec = catalog.get_checkpoint(ck)
    assert rec is not None and rec.state == DURABLE and rec.in_store and rec.last_error == ""


def test_only_the_lifecycle_changes_a_state_through_the_catalog(catalog: Catalog) -> None:
    ck = new(catalog, STAGED)
    with pytest.raises(TypeError, match="lifecycle"):
        catalog.update_checkpoint(ck, state=DURABLE)
    catalog.update_checkpoint(ck, drained_bytes=5)  # (other fields: anyone)
    rec = catalog.get_checkpoint(ck)
    assert rec is not None and rec.state == STAGED and rec.drained_bytes == 5


def test_no_module_but_the_lifecycle_adds_deletes_or_changes_the_state_or_marks_of_a_checkpoint() -> None:
    writers = ("add_checkpoint", "delete_checkpoint", "update_if_state", "merge_meta")
    found = []
    for path in PKG.rglob("*.py"):
        if path.name == "lifecycle.py" and path.parent == PKG:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in writers:
                found.append(f"{path.relative_to(PKG.parent)}:{node.lineno} {node.func.attr}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr == "update_checkpoint" and any(k.arg in ("state", "meta") for k in node.keywords):
                found.append(f"{path.relative_to(PKG.parent)}:{node.lineno} update_checkpoint(state/meta=...)")
    assert found == []


def test_marks_are_set_and_cleared_by_name_and_type_only(catalog: Catalog) -> None:
    ck = new(catalog, STAGED)
    assert lifecycle.mark(catalog, ck, moved_to="n2", hold=True)
    assert lifecycle.mark(catalog, ck, hold=None)
    rec = catalog.get_checkpoint(ck)
    assert rec is not None and rec.meta == {"moved_to": "n2"} and rec.marks.moved_to == "n2"
    with pytest.raises(TypeError, match="not a checkpoint mark"):
        lifecycle.mark(catalog, ck, moved_too="n2")
    with pytest.raises(TypeError, match="takes"):
        lifecycle.mark(catalog, ck, hold="yes")
    with pytest.raises(TypeError, match="lifecycle.mark"):
        catalog.update_checkpoint(ck, meta={"hold": True})
    assert not lifecycle.mark(catalog, "ck-gone", hold=True)  # (deleted meanwhile: nothing to mark)


def _mark_each(catalog: Catalog, ck: str, marks: dict[str, object]) -> None:
    for k, v in marks.items():
        lifecycle.mark(catalog, ck, **{k: v})


def test_two_writers_of_different_marks_never_lose_each_others(catalog: Catalog,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The drain records its counts while a move journals its commit: both marks stay (read-modify-write of the
    whole meta by each writer lost one of them). The catalog's JSON parsing is slowed to widen the window."""
    import json
    import time
    import types

    import memsnap.catalog

    slow = types.SimpleNamespace(dumps=json.dumps, loads=lambda raw: (time.sleep(0.0005), json.loads(raw))[1])
    monkeypatch.setattr(memsnap.catalog, "json", slow)
    drain = {"store": {"chunks": 1}, "phases": {"dump": 1.0}, "restore_phases": {"restore": 1.0},
             "fingerprint": {"pages-1.img": [1, 2, 3, 4]}}
    move = {"lazy_move": "n2", "committing_to": "n2", "moved_to": "n2", "moved_job": "job-2", "hold": True}
    for i in range(10):
        ck = new(catalog, DRAINING, f"ck-{i}")
        threads = [threading.Thread(target=_mark_each, args=(catalog, ck, marks)) for marks in (drain, move)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rec = catalog.get_checkpoint(ck)
        assert rec is not None and rec.meta == {**drain, **move}


def test_a_waiter_wakes_on_the_transition_not_at_its_next_tick(catalog: Catalog) -> None:
    ck = new(catalog, DRAINING)
    got: list[CheckpointRecord | None] = []
    waiter = threading.Thread(target=lambda: got.append(lifecycle.wait(
        catalog, ck, lambda r: r is not None and r.state in lifecycle.SETTLED, timeout=600, tick=600)))
    waiter.start()
    lifecycle.advance(catalog, ck, DURABLE)
    waiter.join(60)  # (it would sleep its 600 s tick if nothing woke it)
    assert not waiter.is_alive()
    assert got and got[0] is not None and got[0].state == DURABLE


def test_a_waiter_sees_a_deleted_checkpoint_as_none_and_gives_up_when_no_longer_active(catalog: Catalog) -> None:
    ck = new(catalog, STAGED)
    lifecycle.forget(catalog, ck)
    assert lifecycle.wait(catalog, ck, lambda r: r is None, timeout=600) is None
    ck = new(catalog, STAGED, "ck-2")
    rec = lifecycle.wait(catalog, ck, lambda r: False, timeout=600, active=lambda: False)
    assert rec is not None and rec.state == STAGED


def test_a_new_checkpoint_id_is_one_a_receiving_node_accepts_and_sorts_by_time() -> None:
    from memsnap.move.stream import CKPT_ID

    ids = [lifecycle.new_id() for _ in range(50)]
    assert len(set(ids)) == 50 and all(CKPT_ID.match(i) for i in ids)
    assert ids[0][:18] <= ids[-1][:18]  # (ck-YYYYmmdd-HHMMSS first)
