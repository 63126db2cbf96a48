"""The cgroup v2 code paths of memsnap.guard.cgroups against a fake cgroupfs directory.

This node's memory controller is held by cgroup v1, so a cgroup2 hierarchy mounted here (even in a new
mount namespace) has no memory controller: memory.max/high/events cannot be exercised for real. These
tests check what the v2 code writes and reads; tests/e2e/test_guard.py runs the v1 paths for real.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from memsnap.guard.cgroups import CgroupV1, CgroupV2, detect

M = 1 << 20


def fake_v2(tmp_path: Path) -> Path:
    root = tmp_path / "cg2"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text("")
    return root


def fake_job(cg: Path, current: int = 0, events: str = "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n") -> None:
    cg.mkdir(parents=True, exist_ok=True)
    for name, text in (("memory.max", "max\n"), ("memory.high", "max\n"), ("memory.current", f"{current}\n"),
                       ("memory.events", events), ("memory.oom.group", "0\n"), ("cgroup.procs", ""),
                       ("cgroup.subtree_control", "")):
        if not (cg / name).exists():
            (cg / name).write_text(text)


def test_detect_picks_v2_for_a_unified_root(tmp_path: Path) -> None:
    root = fake_v2(tmp_path)
    cg = detect(str(root), "memsnap")
    assert isinstance(cg, CgroupV2) and cg.version == 2
    assert "cgroup v2" in cg.describe()


def test_detect_picks_v1_for_the_memory_controller_here() -> None:
    if not Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists():
        pytest.skip("no v1 memory controller on this node")
    assert isinstance(detect(), CgroupV1)


def test_setup_enables_the_memory_controller_for_job_cgroups(tmp_path: Path) -> None:
    root = fake_v2(tmp_path)
    fake_job(root / "memsnap")
    cg = CgroupV2(root, "memsnap")
    cg.setup()
    assert (root / "cgroup.subtree_control").read_text() == "+memory"
    assert (root / "memsnap" / "cgroup.subtree_control").read_text() == "+memory"


def test_limit_sets_high_at_the_limit_and_max_above_it(tmp_path: Path) -> None:
    root = fake_v2(tmp_path)
    cg = CgroupV2(root, "memsnap")
    fake_job(root / "memsnap" / "j1")
    path = cg.create("j1", 256 * M)
    assert int((path / "memory.high").read_text()) == 256 * M
    assert int((path / "memory.max").read_text()) == 256 * M + int(256 * M * 0.10)
    assert (path / "memory.oom.group").read_text() == "1"
    cg.set_limit(path, 1024 * M)  # raise: max first, then high
    assert int((path / "memory.high").read_text()) == 1024 * M
    assert int((path / "memory.max").read_text()) > 1024 * M
    cg.set_limit(path, 64 * M)  # lower: high first, then max; the hard stop keeps at least 16 MiB of room
    assert int((path / "memory.high").read_text()) == 64 * M
    assert int((path / "memory.max").read_text()) == 80 * M


def test_sample_reads_current_high_and_events(tmp_path: Path) -> None:
    root = fake_v2(tmp_path)
    cg = CgroupV2(root, "memsnap")
    fake_job(root / "memsnap" / "j1", current=300 * M, events="low 0\nhigh 7\nmax 0\noom 0\noom_kill 2\n")
    path = cg.create("j1", 256 * M)
    s = cg.sample(path)
    assert (s.usage, s.limit, s.at_limit, s.oom_kills) == (300 * M, 256 * M, True, 2)
    (path / "memory.current").write_text(f"{100 * M}\n")
    assert cg.sample(path).at_limit is False


def test_headroom_raises_high_and_max_past_current_usage(tmp_path: Path) -> None:
    root = fake_v2(tmp_path)
    cg = CgroupV2(root, "memsnap")
    fake_job(root / "memsnap" / "j1", current=290 * M)
    path = cg.create("j1", 256 * M)
    new = cg.give_headroom(path, 32 * M)
    assert new == 322 * M
    assert int((path / "memory.high").read_text()) == 322 * M
    assert int((path / "memory.max").read_text()) >= 322 * M


def test_events_watch_is_an_fd_on_memory_events(tmp_path: Path) -> None:
    root = fake_v2(tmp_path)
    cg = CgroupV2(root, "memsnap")
    fake_job(root / "memsnap" / "j1")
    path = cg.create("j1", 256 * M)
    fd = cg.watch(path)
    try:
        assert os.readlink(f"/proc/self/fd/{fd}") == str(path / "memory.events")
        cg.ack(fd)
    finally:
        os.close(fd)


@pytest.mark.root
def test_a_cgroup2_mount_here_has_no_memory_controller(tmp_path: Path) -> None:
    """Documents why the v2 paths above run against a fake: v1 holds the memory controller on this node."""
    if os.geteuid() != 0:
        pytest.skip("mounting needs root")
    mnt = tmp_path / "cg2"
    mnt.mkdir()
    r = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t cgroup2 none {mnt} && cat {mnt}/cgroup.controllers"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount cgroup2 in a mount namespace: {r.stderr.strip()}")
    if "memory" in r.stdout.split():
        pytest.fail("this node's cgroup2 has the memory controller: run the v2 paths for real instead")
