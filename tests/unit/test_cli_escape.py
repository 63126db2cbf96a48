"""Human output escapes what users named (controls, ESC, DEL, C1, bidi overrides); JSON keeps it exact.

A job command with a newline broke `memsnapctl jobs`; a name or command with terminal escape sequences was
printed raw on root's terminal (issue #28 item 5). tests/e2e/test_cli_escape.py runs the real thing.
"""

from __future__ import annotations

import io
import json
from types import SimpleNamespace
from typing import Any

import click
import pytest

from memsnap import cli, cli_fmt
from memsnap.cli_fmt import printable

NASTY = "run\nnext \x1b[31mred\x1b[0m \r\x07\x7f\x9b2J \u202eevil\u202c \u2066x\u2069\u2028"


def test_printable_escapes_every_control_a_terminal_acts_on_and_nothing_else() -> None:
    assert printable(NASTY) == ("run\\nnext \\x1b[31mred\\x1b[0m \\r\\x07\\x7f\\x9b2J \\u202eevil\\u202c "
                                "\\u2066x\\u2069\\u2028")
    for c in [*map(chr, range(0x20)), *map(chr, range(0x7F, 0xA0)), "\u061c", "\u200e", "\u200f",
              *map(chr, range(0x202A, 0x202F)), *map(chr, range(0x2066, 0x206A))]:
        assert printable(c).isprintable() and printable(c).startswith("\\"), repr(c)
    for fine in ("train-1", "名前", "\U0001F600", "a b\\c", "ü", ""):
        assert printable(fine) == fine


def test_a_table_keeps_one_line_per_row_whatever_its_cells_hold() -> None:
    out = cli_fmt.table([["job-1", NASTY], ["job-2", "plain"]], ["JOB", "COMMAND"])
    lines = out.split("\n")
    assert len(lines) == 3 and "\x1b" not in out and "\u202e" not in out
    assert lines[1].startswith("job-1  run\\nnext \\x1b[31mred")


@pytest.mark.parametrize("output", ["table", "wide", "json", "yaml"])
def test_emit_escapes_human_lines_and_keeps_json_exact(capsys: pytest.CaptureFixture[str], output: str) -> None:
    ctx = cli.Ctx(output=output)
    ctx.emit({"name": NASTY}, [f"name  {NASTY}", "next line"], "wide \x1b[2J\nsecond")  # (a str: lines kept)
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u202e" not in out and "\x9b" not in out
    if output == "json":
        assert json.loads(out) == {"name": NASTY}
    elif output == "table":
        assert out.splitlines() == [f"name  {printable(NASTY)}", "next line"]
    elif output == "wide":
        assert out.splitlines() == ["wide \\x1b[2J", "second"]
    else:
        assert out.startswith('name: "run\\nnext \\u001b[31mred')


def test_yaml_quotes_a_string_with_controls_and_round_trips_it_as_json_escapes() -> None:
    assert cli_fmt.to_yaml({"a": "x\x1by"}) == 'a: "x\\u001by"'
    assert json.loads(cli_fmt.to_yaml("x\x1by\u202e")) == "x\x1by\u202e"


def test_an_error_is_one_printable_line_and_exact_in_json(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.fail("NOT_FOUND", f"no job {NASTY!s}")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err and err.startswith("memsnapctl: NOT_FOUND: no job run\\n")
    with pytest.raises(SystemExit):
        cli.fail("NOT_FOUND", f"no job {NASTY!s}", "json")
    assert json.loads(capsys.readouterr().err)["error"]["message"] == f"no job {NASTY}"


def test_a_usage_error_quoting_what_was_typed_is_printed_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["\x1b]0;owned\x07show"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "\x1b" not in err and "\x07" not in err and "\\x1b]0;owned\\x07show" in err


def test_progress_lines_escape_the_label_and_the_drain_error() -> None:
    out = io.StringIO()
    p = cli_fmt.Progress("ck-\x1b[2J", out, tty=False)
    p.update(1, 2, "draining", "storage error: \x1b[31mboom\nnext")
    text = out.getvalue()
    assert text.count("\n") == 1 and "\x1b" not in text and "ck-\\x1b[2J" in text and "boom\\nnext" in text


def test_the_logs_header_line_is_escaped_and_the_jobs_own_output_is_not() -> None:
    class Client:
        def job_logs(self, job: str, follow: bool, tail_bytes: int) -> Any:
            return [SimpleNamespace(data=b"# memsnap: restored from ck-\x1b[31m; earlier output: /x\n\x1b[1mjob"),
                    SimpleNamespace(data=b" output\x1b[0m\n")]

    got = b"".join(cli.jobs._log_chunks(Client(), "j", False, 0))  # type: ignore[arg-type]
    assert got == b"# memsnap: restored from ck-\\x1b[31m; earlier output: /x\n\x1b[1mjob output\x1b[0m\n"


def test_click_messages_go_through_the_escaping_stream() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:  # (click strips ANSI sequences itself, but only off a terminal)
            return True

    buf = Terminal()
    click.echo("Error: no such command '\x1b[31m'\nUsage: x", file=cli_fmt.printable_stream(buf))
    assert buf.getvalue() == "Error: no such command '\\x1b[31m'\nUsage: x\n"


def test_the_slurm_launchers_lines_escape_what_users_named() -> None:
    """memsnap-slurm's stderr lines land in the job's Slurm output file, which users read in a terminal."""
    import io
    from types import SimpleNamespace

    from memsnap.slurm.launcher import Launcher

    err = io.StringIO()
    Launcher.note(SimpleNamespace(err=err), "resumed job 'x\nmemsnap-slurm: forged\x1b[2J' from ck-1")  # type: ignore[arg-type]
    assert err.getvalue() == "memsnap-slurm: resumed job 'x\\nmemsnap-slurm: forged\\x1b[2J' from ck-1\n"
