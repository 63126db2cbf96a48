"""Fixtures: one real memsnapd shared by the e2e tests, plus factories for tests that need their own."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.helpers import DaemonProc, Pair, kill_counters_started_since, kill_job, two_daemons

# Test daemons keep their state (job logs included) and the tests their files in /var/tmp, not /tmp: a job
# gets a /tmp of its own (memsnap.mounts), which would hide them from it (memsnapd then turns that off).
tempfile.tempdir = "/var/tmp"

if TYPE_CHECKING:
    from tests.s3server import S3Server


def _criu_ready() -> None:
    if os.geteuid() != 0:
        pytest.fail("the e2e tests run real CRIU and must run as root (CI does)")
    if not (shutil.which("criu") or os.access("/usr/local/sbin/criu", os.X_OK)):
        pytest.fail("criu is not installed: run scripts/install-criu.sh (CI does)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks the fast tier: scripts/test.sh runs `-m "unit and not root"` as uid 65534, the rest as root."""
    unit = Path(__file__).resolve().parent / "unit"
    for item in items:
        if unit in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.unit)


@pytest.fixture(autouse=True)
def no_temp_dir_outlives_the_test() -> Iterator[None]:
    """Every tempfile.mkdtemp() a test (or its fixtures) makes in this process must be gone at its end:
    a left one is removed and the test errors, naming it."""
    made: list[str] = []
    real = tempfile.mkdtemp

    def tracking(*args: object, **kw: object) -> str:
        d = real(*args, **kw)  # type: ignore[arg-type]
        made.append(str(d))
        return str(d)

    tempfile.mkdtemp = tracking  # type: ignore[assignment]
    try:
        yield
    finally:
        tempfile.mkdtemp = real
    left = [d for d in made if os.path.lexists(d)]
    for d in left:
        shutil.rmtree(d, ignore_errors=True)
    assert not left, f"temp dirs left behind (removed now): {left}"


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A short-named temp dir any user may traverse (0755; for sockets nobody must reach), removed after."""
    d = Path(tempfile.mkdtemp(prefix="memsnap-t-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A session-wide moto S3 server with one bucket. boto3 and moto are imported only when a test asks
    for it, so that test trees that never do (tests/gpu, carried to a GPU node) need neither."""
    from tests.s3server import running_s3_server

    with running_s3_server() as info:
        yield info


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    """A real memsnapd on a temp socket with temp tier/store/state dirs, shared by e2e tests."""
    _criu_ready()
    d = DaemonProc(tmp_path_factory.mktemp("memsnapd"))
    d.start()
    yield d
    d.cleanup()


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[object]:
    """Factory for tests that need their own daemon (odd config, kill -9, small tier)."""
    _criu_ready()
    made: list[DaemonProc] = []

    def make(name: str = "d", extra: list[str] | None = None, **kw: object) -> DaemonProc:
        d = DaemonProc(tmp_path / name, extra=extra or [], **kw)  # type: ignore[arg-type]
        made.append(d)
        return d

    yield make
    for d in made:
        d.cleanup()


@pytest.fixture
def jobs_to_kill() -> Iterator[list[int]]:
    """Pids a test started; killed at teardown so nothing leaks between tests."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        kill_job(pid)


@pytest.fixture
def open_daemon(make_daemon: object, tmp_path: Path) -> Iterator[DaemonProc]:
    """A real memsnapd whose socket any local user reaches (mode 0666 in a 0755 dir): for attacks run as
    uid 65534 over the real socket, where only the daemon's own checks stand in the way."""
    cfg = tmp_path / "open.toml"
    cfg.write_text('[daemon]\nsocket_mode = "0666"\n')
    sockdir = Path(tempfile.mkdtemp(prefix="memsnap-open-"))
    os.chmod(sockdir, 0o755)
    d = make_daemon("open", extra=["--config", str(cfg)], socket_path=str(sockdir / "d.sock"))  # type: ignore[operator]
    d.start()
    yield d
    d.cleanup()
    shutil.rmtree(sockdir, ignore_errors=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """Two cluster daemons for moves, one pair per test module."""
    yield from two_daemons(tmp_path_factory)


@pytest.fixture
def no_copy_outlives_the_test() -> Iterator[None]:
    """Kills every counter workload started during the test (modules with moves use it for every test)."""
    t0 = time.time() - 1
    yield
    kill_counters_started_since(t0)
