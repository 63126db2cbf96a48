"""`memsnapctl show` of a GPU checkpoint: host and device bytes apart, one GPU line per process and GPU, and the
phases of the checkpoint and of its last restore (from the catalog record, through the proto)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner

from memsnap import cli
from memsnap.catalog import CheckpointRecord
from memsnap.convert import ckpt_pb

GIB = 1 << 30
UUID = "GPU-00112233-4455-6677-8899-aabbccddeeff"
# What memsnap.gpu.adapter.describe wrote into the manifest (and the catalog keeps): one entry per CUDA process.
GPUS = [{"pid": 101, "ns_pid": 2, "gpus": [{"uuid": UUID, "model": "NVIDIA H200", "bytes": 32 * GIB}],
         "device_bytes": 32 * GIB, "driver_version": "580.159.04"},
        {"pid": 102, "ns_pid": 3, "gpus": [], "device_bytes": 0, "driver_version": "580.159.04"}]
PHASES = {"quiesce": 0.012, "gpu_lock": 0.2, "gpu_checkpoint": 14.9, "freeze": 17.3, "dump": 17.4,
          "publish": 2.6}


def _rec() -> CheckpointRecord:
    return CheckpointRecord(id="ck-1", state="staged", pid=100, owner_uid=0, created_ms=1, size_bytes=37 * GIB,
                            in_tier=True, meta={"gpus": GPUS, "phases": PHASES,
                                                "restore_phases": {"verify": 0.5, "criu_restore": 16.9,
                                                                   "gpu_restore": 6.4, "gpu_unlock": 0.001}})


def test_the_proto_splits_host_and_device_bytes_and_names_each_gpu() -> None:
    k = ckpt_pb(_rec())
    assert (k.device_bytes, k.host_bytes) == (32 * GIB, 5 * GIB)
    assert [(g.pid, g.model, g.uuid, g.device_bytes) for g in k.gpus] == \
        [(101, "NVIDIA H200", UUID, 32 * GIB), (102, "", "", 0)]
    assert [(p.name, p.ms) for p in k.phases] == [("quiesce", 12), ("gpu_lock", 200), ("gpu_checkpoint", 14900),
                                                  ("freeze", 17300), ("dump", 17400), ("publish", 2600)]
    assert [p.name for p in k.restore_phases] == ["verify", "criu_restore", "gpu_restore", "gpu_unlock"]


def test_junk_in_a_record_never_fails_the_listing() -> None:
    rec = _rec()
    rec.meta = {"gpus": [{"pid": "x", "gpus": "nope", "device_bytes": "lots"}, 7], "phases": {"dump": "slow"}}
    k = ckpt_pb(rec)
    assert k.device_bytes == 0 and k.host_bytes == 37 * GIB and list(k.phases) == []


class _Client:
    def __enter__(self) -> _Client:
        return self

    def __exit__(self, *a: object) -> None:
        pass

    def show(self, ckpt_id: str) -> Any:
        return ckpt_pb(_rec())


@pytest.mark.parametrize("output", ["table", "json"])
def test_show_prints_them(monkeypatch: pytest.MonkeyPatch, output: str) -> None:
    monkeypatch.setattr(cli.Ctx, "client", lambda self: _Client())
    r = CliRunner().invoke(cli.cli, ["-o", output, "show", "ck-1"])
    assert r.exit_code == 0, r.output
    if output == "json":
        d = json.loads(r.output)
        assert d["host_bytes"] == 5 * GIB and d["device_bytes"] == 32 * GIB
        assert d["phases"][2] == {"name": "gpu_checkpoint", "ms": 14900}
        return
    assert "size        37.0 GiB (host 5.0 GiB + device 32.0 GiB)" in r.output
    assert "phases      quiesce 12 ms, gpu_lock 200 ms, gpu_checkpoint 14.9 s, freeze 17.3 s, dump 17.4 s, " \
           "publish 2.6 s" in r.output
    assert "restored in verify 500 ms, criu_restore 16.9 s, gpu_restore 6.4 s, gpu_unlock 1 ms" in r.output
    assert f"gpu         NVIDIA H200 {UUID} driver 580.159.04 32.0 GiB (pid 101)" in r.output
