"""One grammar for sizes and rates: memsnap.units parses them, and the config file and memsnapctl agree with it on
every spelling (a size the one accepts the others accept, as the same number of bytes; one it refuses they refuse).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from memsnap import cli
from memsnap.config import ConfigError, load_config
from memsnap.units import parse_rate, parse_size

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

# (what a person types, the bytes it means; None: refused everywhere)
SIZES: list[tuple[str, int | None]] = [
    ("4096", 4096),
    ("1", 1),
    ("123", 123),
    ("512K", 512 * KiB),
    ("512k", 512 * KiB),
    ("100M", 100 * MiB),
    ("256M", 256 * MiB),
    ("1G", GiB),
    ("4G", 4 * GiB),
    ("2T", 2 * TiB),
    ("1Ki", KiB),
    ("1KiB", KiB),
    ("4mib", 4 * MiB),
    ("10MB", 10 * MiB),  # (binary: B is only a word)
    ("100B", 100),
    (" 8 M ", 8 * MiB),
    ("1.5G", 3 * GiB // 2),
    ("1.5GiB", 3 * GiB // 2),
    ("0.5K", 512),
    (".5G", GiB // 2),
    ("1.1G", 1181116006),  # 1181116006.4 bytes: a fraction with a unit is rounded to the nearest byte
    ("1.0", 1),
    ("8388607T", 8388607 * TiB),
    # refused
    ("1.5", None),  # a fraction of a byte (the CLI took it as 1 byte)
    ("100M/s", None),  # a rate, not a size (the config file took it as 100M)
    ("0", None),  # no size (the CLI took it as no limit)
    ("0K", None),
    ("", None),
    ("abc", None),
    ("-1", None),
    ("1X", None),
    ("1KK", None),
    ("M", None),
    ("1 G B B", None),
    ("1e6", None),
    ("1iB", None),  # (the CLI took it as 1 byte)
    ("8388608T", None),  # over 2^63 - 1 bytes
]

RATES: list[tuple[str, int | None]] = [
    ("100M/s", 100 * MiB),
    ("100M", 100 * MiB),  # (per second is implied)
    ("10M/s", 10 * MiB),
    ("1.5GiB/s", 3 * GiB // 2),
    ("1.5M/s", 3 * MiB // 2),
    ("500k/S", 500 * KiB),
    ("200M /s", 200 * MiB),
    ("1.5/s", None),
    ("0/s", None),
    ("/s", None),
    ("100M/h", None),
    ("100M/s/s", None),
]


def _units(parse: Any, text: str) -> int | None:
    try:
        return int(parse(text))
    except ValueError as exc:
        assert "size" in str(exc) and "\n" not in str(exc)  # (one line that names what it wanted)
        return None


def _config(tmp_path: Path, section: str, key: str, text: str) -> int | None:
    path = tmp_path / "memsnap.toml"
    path.write_text(f"[{section}]\n{key} = {json.dumps(text)}\n")
    try:
        value: int | None = getattr(getattr(load_config(str(path), {}), section), key)
    except ConfigError as exc:
        assert f"{section}.{key}: expected" in str(exc)
        return None
    assert value is not None or not text.strip()  # ("" is the config file's "not set")
    return value


class _Client:
    """Records what `memsnapctl run` asks the daemon for."""

    def __init__(self, seen: list[dict[str, Any]]) -> None:
        self.seen = seen

    def __enter__(self) -> _Client:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def run(self, argv: list[str], **kwargs: Any) -> Any:
        self.seen.append(kwargs)
        return SimpleNamespace(id="job-1", pid=7, name="n", log_path="/l")


def _cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], text: str) -> int | None:
    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(cli.Ctx, "client", lambda self: _Client(seen))
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", "--memory-limit", text, "--", "true"])
    err = capsys.readouterr().err
    if exc.value.code == 0:
        limit = seen[0]["memory_limit"]
        return int(limit) if limit or text else None  # ("": the flag's "no limit")
    assert exc.value.code == 2 and "Invalid value for --memory-limit: " in err and not seen
    return None


@pytest.mark.parametrize(("text", "want"), SIZES)
def test_units_the_config_file_and_the_cli_agree_on_a_size(
        text: str, want: int | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    got = {"units": _units(parse_size, text), "config": _config(tmp_path, "guard", "headroom", text),
           "cli": _cli(monkeypatch, capsys, text)}
    assert got == dict.fromkeys(got, want)


@pytest.mark.parametrize(("text", "want"), RATES)
def test_units_and_the_config_file_agree_on_a_rate(text: str, want: int | None, tmp_path: Path) -> None:
    got = {"units": _units(parse_rate, text), "config": _config(tmp_path, "drain", "bandwidth", text),
           "override": _override("drain.bandwidth", text)}
    assert got == dict.fromkeys(got, want)


def _override(key: str, text: str) -> int | None:
    """What memsnapd --drain-bandwidth TEXT gives (a flag overrides a key)."""
    try:
        section, _, name = key.partition(".")
        value: int | None = getattr(getattr(load_config("/dev/null", {key: text}), section), name)
        return value
    except ConfigError:
        return None


def test_a_size_is_not_a_rate_and_says_what_to_write_instead() -> None:
    with pytest.raises(ValueError, match="drop the /s"):
        parse_size("100M/s")
    with pytest.raises(ValueError, match="add a unit"):
        parse_size("1.5")
