"""Every integrity refusal, through a real daemon: a tier or store copy that is not exactly the image memsnap
signed is refused with DATA_LOSS, starts no process and leaves no file behind."""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from memsnap import manifest
from tests.helpers import (
    DaemonProc,
    checkpoint_json,
    file_names,
    restore_refused,
    running_job_pids,
    start_counter,
    stored_chunk,
    ticks,
)


def _load(p: Path) -> dict[str, Any]:
    return dict(json.loads(p.read_text()))


def _save(p: Path, m: dict[str, Any]) -> None:
    p.write_text(json.dumps(m))


def _key(d: DaemonProc) -> bytes:
    return (d.state / "hmac.key").read_bytes()


def _biggest(d: Path) -> Path:
    return max((p for p in d.iterdir() if p.name != manifest.MANIFEST), key=lambda p: p.stat().st_size)


def _smallest(d: Path) -> Path:
    return min((p for p in d.iterdir() if p.name != manifest.MANIFEST), key=lambda p: p.stat().st_size)


# Each tamper gets (daemon, images dir, manifest path) and returns the words the refusal must carry.
def _unsigned(d: DaemonProc, img: Path, mp: Path) -> str:
    m = _load(mp)
    del m["signature"]
    _save(mp, m)
    return "not signed"


def _edited(d: DaemonProc, img: Path, mp: Path) -> str:
    m = _load(mp)
    m["argv"] = ["/bin/sh", "-c", "id > /tmp/pwned"]
    _save(mp, m)
    return "signature does not match"


def _wrong_key(d: DaemonProc, img: Path, mp: Path) -> str:
    _save(mp, manifest.sign(_load(mp), secrets.token_bytes(32)))
    return "signature does not match"


def _extra_file(d: DaemonProc, img: Path, mp: Path) -> str:
    (img / "planted.img").write_bytes(b"x" * 100)
    return "unexpected files"


def _missing_file(d: DaemonProc, img: Path, mp: Path) -> str:
    _smallest(img).unlink()
    return "missing"


def _wrong_size(d: DaemonProc, img: Path, mp: Path) -> str:
    with open(_biggest(img), "ab") as f:
        f.write(b"\0")
    return "bytes, manifest says"


def _dotdot_name(d: DaemonProc, img: Path, mp: Path) -> str:
    m = _load(mp)
    victim = _smallest(img)
    m["files"]["../" + victim.name] = m["files"].pop(victim.name)
    victim.rename(img.parent / ("dotdot-" + victim.name))  # what ../NAME would reach, if it were followed
    _save(mp, manifest.sign(m, _key(d)))  # signed with the node's own key: only the name check stands
    return "bad file name"


TIER_TAMPERS: dict[str, Callable[[DaemonProc, Path, Path], str]] = {
    "unsigned": _unsigned, "edited": _edited, "wrong-key": _wrong_key, "extra-file": _extra_file,
    "missing-file": _missing_file, "wrong-size": _wrong_size, "dotdot-name": _dotdot_name,
}


def _refused_with_nothing_left(d: DaemonProc, ckpt_id: str, log: str, words: str, jobs_to_kill: list[int]) -> None:
    jobs, files, pids = running_job_pids(d), file_names(d.tier, d.state), {t.hostpid for t in ticks(log)}
    r = restore_refused(d, ckpt_id, jobs_to_kill)
    assert r.returncode != 0 and "DATA_LOSS" in r.stderr and words in r.stderr, r.stderr
    time.sleep(0.5)  # a copy started by mistake would have printed its first tick by now
    assert running_job_pids(d) == jobs
    assert {t.hostpid for t in ticks(log)} == pids
    assert file_names(d.tier, d.state) <= files  # nothing new (a refused fetch leaves no partial copy)


@pytest.mark.parametrize("tamper", list(TIER_TAMPERS), ids=list(TIER_TAMPERS))
def test_tampered_tier_copy_is_refused_with_data_loss_and_no_process(daemon, jobs_to_kill, tamper):
    job = start_counter(daemon, jobs_to_kill, 8)
    ck = checkpoint_json(daemon, job.id, "--stop")
    img = daemon.tier / str(ck["id"])
    words = TIER_TAMPERS[tamper](daemon, img, img / manifest.MANIFEST)
    _refused_with_nothing_left(daemon, str(ck["id"]), job.log, words, jobs_to_kill)


# The store copy: the same refusals on the way back from the store (memsnap.drain fetch).
def _store_unsigned(d: DaemonProc, sd: Path, mp: Path) -> str:
    return _unsigned(d, sd, mp)


def _store_edited(d: DaemonProc, sd: Path, mp: Path) -> str:
    return _edited(d, sd, mp)


def _store_wrong_key(d: DaemonProc, sd: Path, mp: Path) -> str:
    return _wrong_key(d, sd, mp)


def _a_stored_chunk(d: DaemonProc, mp: Path) -> tuple[Path, int, int]:
    """The object holding the first chunk of the image's biggest file, and that chunk's place in it."""
    m = _load(mp)
    big = max(m["files"], key=lambda n: m["files"][n]["size"])
    return stored_chunk(d.store, m, m["storage"]["files"][big]["chunks"][0][0])


def _store_missing_object(d: DaemonProc, sd: Path, mp: Path) -> str:
    _a_stored_chunk(d, mp)[0].unlink()
    return "integrity check failed"


def _store_wrong_size(d: DaemonProc, sd: Path, mp: Path) -> str:
    obj, off, n = _a_stored_chunk(d, mp)
    os.truncate(obj, off + n - 1)
    return "integrity check failed"


def _store_dotdot_name(d: DaemonProc, sd: Path, mp: Path) -> str:
    m = _load(mp)
    name = next(iter(m["files"]))
    m["files"]["../" + name] = m["files"].pop(name)
    m["storage"]["files"]["../" + name] = m["storage"]["files"].pop(name)
    _save(mp, manifest.sign(m, _key(d)))
    return "bad entry"


def _store_other_list(d: DaemonProc, sd: Path, mp: Path) -> str:
    m = _load(mp)
    m["storage"]["files"].pop(next(iter(m["storage"]["files"])))
    _save(mp, manifest.sign(m, _key(d)))
    return "lists other files"


STORE_TAMPERS: dict[str, Callable[[DaemonProc, Path, Path], str]] = {
    "unsigned": _store_unsigned, "edited": _store_edited, "wrong-key": _store_wrong_key,
    "missing-object": _store_missing_object, "wrong-size": _store_wrong_size, "dotdot-name": _store_dotdot_name,
    "other-file-list": _store_other_list,
}


@pytest.mark.parametrize("tamper", list(STORE_TAMPERS), ids=list(STORE_TAMPERS))
def test_tampered_store_copy_is_refused_with_data_loss_and_no_process(daemon, jobs_to_kill, tamper):
    job = start_counter(daemon, jobs_to_kill, 8)
    ck = checkpoint_json(daemon, job.id, "--stop", "--wait", "durable")
    daemon.ctl("evict", str(ck["id"]), check=True)
    sd = daemon.store / str(ck["id"])
    words = STORE_TAMPERS[tamper](daemon, sd, sd / manifest.MANIFEST)
    _refused_with_nothing_left(daemon, str(ck["id"]), job.log, words, jobs_to_kill)
    assert not (daemon.tier / str(ck["id"])).exists()
