"""tests/helpers.start_on_free_ports: a port taken between the draw and the daemon's bind is drawn again
(the free_port() race of the --listen tests), with stand-in daemons that really bind their port."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers import start_on_free_ports


@dataclass
class Listener:
    """Enough of a DaemonProc: start() binds its port like memsnapd, and logs memsnapd's words on failure."""

    log: Path
    port: int
    sock: socket.socket | None = None
    proc: None = None
    stops: list[int] = field(default_factory=list)

    def start(self) -> Listener:
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", self.port))
        except OSError:
            s.close()
            with open(self.log, "a") as f:
                f.write(f"memsnapd: cannot listen on 127.0.0.1:{self.port}: the address is in use or not local\n")
            raise AssertionError("memsnapd exited with 1") from None
        s.listen()
        self.sock = s
        return self

    def stop(self, sig: int = 0) -> None:
        self.stops.append(sig)


def test_a_port_taken_before_the_bind_is_drawn_again(tmp_path: Path) -> None:
    thief = socket.socket()
    made: list[Listener] = []

    def make(ports: list[int]) -> list[Listener]:
        if not made:  # someone else takes the first port right after it was found free
            thief.bind(("127.0.0.1", ports[0]))
            thief.listen()
        made.append(Listener(tmp_path / "d.log", ports[0]))
        return made[-1:]

    try:
        (d,) = start_on_free_ports(1, make)  # type: ignore[arg-type]
        assert len(made) == 2 and d is made[1] and d.sock is not None
        assert d.port != thief.getsockname()[1]
    finally:
        thief.close()
        for m in made:
            if m.sock is not None:
                m.sock.close()


def test_a_start_that_fails_for_another_reason_is_not_retried(tmp_path: Path) -> None:
    made: list[Listener] = []

    def make(ports: list[int]) -> list[Listener]:
        made.append(Listener(tmp_path / "d.log", 0))
        made[-1].start = lambda: (_ for _ in ()).throw(AssertionError("memsnapd exited with 1"))  # type: ignore
        return made[-1:]

    with pytest.raises(AssertionError, match="exited"):
        start_on_free_ports(1, make)  # type: ignore[arg-type]
    assert len(made) == 1


def test_every_daemon_of_a_group_gets_its_own_port(tmp_path: Path) -> None:
    made: list[Listener] = []

    def make(ports: list[int]) -> list[Listener]:
        made.extend(Listener(tmp_path / f"d{i}.log", p) for i, p in enumerate(ports))
        return made[-len(ports):]

    try:
        ds = start_on_free_ports(3, make)  # type: ignore[arg-type]
        assert len({d.port for d in ds}) == 3 and all(d.sock is not None for d in ds)
    finally:
        for m in made:
            if m.sock is not None:
                m.sock.close()
