"""tier.mount with real daemons and real CRIU: memsnapd mounts its own tmpfs on the tier dir (huge pages, a NUMA
policy), dumps into it, restores from the store, reuses the mount after a kill -9, and never mounts through a
symlink that another user planted."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from memsnap.tier import MemoryTier, MountSpec, host_takes_back_free_memory
from tests.e2e.test_chunkstore import _ckpt, _infer, _restore_and_check
from tests.helpers import NOBODY, REPO, DaemonProc, metrics_port, run_as, sample, scrape_metrics, start_digest, ticks


def _mount_at(path: Path) -> dict[str, str] | None:
    """findmnt's view of the mount whose mount point is path exactly (None: not a mount point)."""
    r = subprocess.run(["findmnt", "-J", "-n", "-o", "ID,TARGET,FSTYPE,SOURCE,FS-OPTIONS", "--mountpoint", str(path)],
                       capture_output=True, text=True, check=False)
    found = [m for m in json.loads(r.stdout)["filesystems"] if m["target"] == str(path)] if r.stdout else []
    return {k: str(v) for k, v in found[-1].items()} if found else None


@pytest.fixture
def unmount() -> Iterator[list[Path]]:
    """Mount points a test made (through its daemon); lazily unmounted and removed at teardown."""
    paths: list[Path] = []
    yield paths
    for p in paths:
        while _mount_at(p) is not None:
            subprocess.run(["umount", "-l", str(p)], check=True)
        with contextlib.suppress(FileNotFoundError):
            p.rmdir()


def _with_config(d: DaemonProc, **tier: object) -> DaemonProc:
    """d with a config file of these [tier] keys (after the --config /dev/null of DaemonProc.args: the last wins)."""
    d.base.mkdir(parents=True, exist_ok=True)
    cfg = d.base / "memsnap.toml"
    cfg.write_text("[tier]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in tier.items()))
    d.extra = ["--config", str(cfg)]
    return d


def _mounting(make_daemon, unmount: list[Path], name: str, **tier: object) -> DaemonProc:
    """A daemon whose config turns tier.mount on (plus the given [tier] keys), its tier a fresh dir in /dev/shm."""
    d: DaemonProc = make_daemon(name)
    unmount.append(d.tier)
    return _with_config(d, mount=True, **tier)


def _refused(d: DaemonProc) -> str:
    """memsnapd's stderr when it refuses to start (it must)."""
    r = subprocess.run(d.args(), capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode != 0, r.stderr
    return r.stderr


def test_a_daemon_with_tier_mount_mounts_a_huge_page_tmpfs_restores_from_the_store_and_reuses_it_after_kill_9(
        unmount, make_daemon, jobs_to_kill):
    d = _mounting(make_daemon, unmount, "mount", capacity="512M", huge_pages="within_size")
    assert _mount_at(d.tier) is None
    d.start()
    m = _mount_at(d.tier)
    assert m is not None and m["fstype"] == "tmpfs" and m["source"] == "memsnap"
    assert {"huge=within_size", "mode=700", "size=524288k"} <= set(m["fs-options"].split(","))
    assert "; tmpfs mounted by memsnapd (huge=within_size, size=524288k)" in d.ctl("status", check=True).stdout
    # (on a VM whose host takes back freed memory, as this one's does, memsnapd says that huge pages cost more)
    assert ("free page reporting" in d.log.read_text()) is host_takes_back_free_memory()
    jid, pid, log = _infer(d, jobs_to_kill, mib=16)
    digest = start_digest(log)
    ck = _ckpt(d, jid, "--stop", "--wait", "durable")
    assert (d.tier / ck["id"] / "manifest.json").is_file()
    last = ticks(log, pid)[-1].n
    d.ctl("evict", ck["id"], check=True)
    assert not (d.tier / ck["id"]).exists()
    r = _restore_and_check(d, ck["id"], log, digest, last, jobs_to_kill)
    assert r["from_store"] is True

    ck2 = _ckpt(d, r["job"], "--stop")
    last = ticks(log, r["pid"])[-1].n
    d.stop(signal.SIGKILL)
    d.start()
    assert _mount_at(d.tier) == m  # the same mount (same id and options): reused, not mounted again
    assert "reusing the mount there (tmpfs mounted by memsnapd (huge=within_size" in d.log.read_text()
    r2 = _restore_and_check(d, ck2["id"], log, digest, last, jobs_to_kill)
    assert r2["from_store"] is False


def test_tier_mount_by_default_takes_huge_pages_unless_the_host_takes_back_freed_memory(unmount, make_daemon):
    d = _mounting(make_daemon, unmount, "auto").start()  # (tier.huge_pages left at its default, auto)
    m = _mount_at(d.tier)
    assert m is not None and m["source"] == "memsnap"
    huge = [o for o in m["fs-options"].split(",") if o.startswith("huge=")]
    said = d.log.read_text()
    if host_takes_back_free_memory():  # (this VM: a virtio balloon with free page reporting)
        assert huge == [] and "4 KiB pages (tier.huge_pages = auto)" in said  # (tmpfs shows no huge= for never)
    else:
        assert huge == ["huge=within_size"] and "tier.huge_pages = auto" not in said
    assert "free page reporting" not in said  # (the warning is for huge pages someone asked for)


@pytest.mark.skipif(not Path("/sys/devices/system/node/node0").is_dir(), reason="no NUMA node 0")
def test_tier_mount_with_kind_numa_binds_the_tmpfs_to_the_node_and_a_stop_leaves_it_mounted(unmount, make_daemon):
    d = _mounting(make_daemon, unmount, "numa", kind="numa", numa_node=0, huge_pages="never")
    d.extra += ["--metrics-listen", "127.0.0.1:0"]
    d.start()
    m = _mount_at(d.tier)
    assert m is not None and m["source"] == "memsnap"
    opts = m["fs-options"].split(",")
    assert "mpol=bind:0" in opts and not any(o.startswith("huge=") for o in opts)
    assert "free page reporting" not in d.log.read_text()  # (no huge pages: nothing to warn of)
    assert sample(scrape_metrics(metrics_port(d)), "memsnap_tier_info", kind="numa", fstype="tmpfs",
                  mounted_by_memsnapd="true", huge_pages="never") == 1
    assert d.stop() == 0
    assert _mount_at(d.tier) == m  # a graceful stop leaves the mount (and the images in it) alone


def test_a_tier_dir_that_is_a_symlink_planted_by_another_user_is_refused_and_nothing_is_mounted(make_daemon):
    # /dev/shm is world-writable (sticky): nobody plants the tier's name there, pointing at a dir of theirs.
    link, target = (Path(f"/dev/shm/memsnap-test-{uuid.uuid4().hex[:8]}") for _ in range(2))
    planted = run_as(NOBODY, "import os, sys; os.mkdir(sys.argv[1]); os.symlink(sys.argv[1], sys.argv[2])",
                     str(target), str(link))
    assert planted.returncode == 0, planted.stderr
    try:
        d = _with_config(make_daemon("link", tier=link), mount=True)
        assert "is a symbolic link" in _refused(d)
        assert _mount_at(target) is None and _mount_at(link) is None
        assert link.is_symlink() and os.listdir(target) == []
    finally:
        link.unlink()
        target.rmdir()


def test_a_tier_dir_under_a_symlink_planted_by_another_user_is_refused_and_nothing_is_created_or_mounted(
        make_daemon):
    # nobody's link in /dev/shm points at a root-owned dir; the tier is configured below the link.
    link, target = (Path(f"/dev/shm/memsnap-test-{uuid.uuid4().hex[:8]}") for _ in range(2))
    target.mkdir(mode=0o755)
    planted = run_as(NOBODY, "import os, sys; os.symlink(sys.argv[1], sys.argv[2])", str(target), str(link))
    assert planted.returncode == 0, planted.stderr
    try:
        d = _with_config(make_daemon("under", tier=link / "tier"), mount=True)
        assert f"lies under {link}, a symbolic link owned by uid {NOBODY}" in _refused(d)
        assert os.listdir(target) == [] and _mount_at(target / "tier") is None
    finally:
        link.unlink()
        while _mount_at(target / "tier") is not None:  # (what the old code did, for a failing run's cleanup)
            subprocess.run(["umount", "-l", str(target / "tier")], check=True)
        shutil.rmtree(target)


def test_tier_mount_does_not_hide_what_the_dir_holds_and_mounts_nothing(tmp_path, caplog):
    root = tmp_path / "tier"
    root.mkdir(mode=0o700)
    (root / "ckpt-1").mkdir()
    tier = MemoryTier(root, mount=MountSpec())
    assert "NOT mounting a tmpfs there: it holds 1 entries (ckpt-1)" in caplog.text
    assert _mount_at(root) is None and not tier.mount_point and tier.published_ids() == ["ckpt-1"]
