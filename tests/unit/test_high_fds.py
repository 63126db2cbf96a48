"""A daemon with more than 1024 files open (its limit raised, as systemd's LimitNOFILE does) gets fd numbers
that select() cannot take: the launcher's status read and the move streamer's inotify wait still work."""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator
from pathlib import Path

import pytest

from memsnap import jobs
from memsnap.dumphash import Inotify

HIGH = 1500


@pytest.fixture
def high_fd_room() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= HIGH + 10:
        pytest.fail(f"the hard RLIMIT_NOFILE here is {hard}: this test needs fd numbers above {HIGH}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, HIGH + 10), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _high(fd: int) -> int:
    high = os.dup2(fd, HIGH)
    os.close(fd)
    return high


def test_the_launch_status_line_is_read_from_a_pipe_numbered_above_1023(high_fd_room: None) -> None:
    r, w = os.pipe()
    r = _high(r)
    try:
        os.write(w, b"ok\n")
        assert jobs._read_status(r, 2.0) == "ok"
    finally:
        os.close(r)
        os.close(w)


def test_image_file_events_are_read_from_an_inotify_fd_numbered_above_1023(high_fd_room: None,
                                                                           tmp_path: Path) -> None:
    ino = Inotify(tmp_path)
    ino.fd = _high(ino.fd)
    try:
        (tmp_path / "pages-1.img").write_bytes(b"x")
        names = {name for _mask, name in ino.events(2.0)}
        assert "pages-1.img" in names
    finally:
        ino.close()
