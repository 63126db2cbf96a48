"""What a user puts in a job reaches root's terminal escaped (issue #28 item 5): a real daemon, real CRIU.

uid 65534 runs a job over the real socket whose command holds a newline, colour and screen-clearing escape
sequences, an OSC title sequence, a C1 CSI and a bidi override (names allow none of these: a name with
them is refused, and the refusal is printed escaped). Root's `jobs`, `jobs -o wide`, `list`, `show` and
`status` then print one line per row and no raw control; `--json` gives back the exact strings.
"""

from __future__ import annotations

import json

from tests.helpers import NOBODY, DaemonProc, run_as

EVIL = ["line1\nline2", "\x1b[31mred\x1b[0m\x1b[2J", "\x1b]0;owned\x07", "\x9b6n", "\u202eevil", "tab\there\r"]
RAW = ("\x1b", "\x07", "\x9b", "\u202e", "\r")


def _no_raw_control(text: str) -> None:
    assert not any(c in text for c in RAW), repr(text)


def test_a_users_command_with_controls_is_escaped_in_roots_tables_and_exact_in_json(open_daemon: DaemonProc,
                                                                                     jobs_to_kill: list[int]) -> None:
    d = open_daemon
    argv = ["sh", "-c", "exec sleep 600", "fake-argv0", *EVIL]
    r = run_as(NOBODY, "import json, sys\nfrom memsnap.client import MemsnapClient\n"
                       "j = MemsnapClient(socket=sys.argv[1]).run(json.loads(sys.argv[2]), cwd='/tmp',"
                       " env={'PATH': '/usr/bin:/bin'})\nprint(json.dumps({'job': j.id, 'pid': j.pid}))",
               d.socket, json.dumps(argv))
    assert r.returncode == 0, r.stderr
    jobs_to_kill.append(int(json.loads(r.stdout)["pid"]))
    refused = d.ctl("run", "--name", "x\x1b[31m\u202e", "--", "sleep", "1", user=NOBODY)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    _no_raw_control(refused.stderr)
    # A checkpoint of the same command (root's: CRIU here dumps no unprivileged task), for list and show.
    mine = json.loads(d.ctl("--json", "run", "--", *argv, check=True).stdout)
    jobs_to_kill.append(int(mine["pid"]))
    ck = json.loads(d.ctl("--json", "checkpoint", mine["job"], check=True).stdout)

    for args in (["jobs"], ["jobs", "-o", "wide"], ["list"], ["list", "-o", "wide"], ["show", ck["id"]], ["status"]):
        out = d.ctl(*args, check=True).stdout  # (root's terminal)
        _no_raw_control(out)
        lines = out.splitlines()
        if args[0] == "jobs":
            assert len(lines) == 3 and all("\\x1b[31mred" in row for row in lines[1:]), lines  # header, 2 rows
        elif args[0] == "list":
            assert len(lines) == 2, lines
        elif args[0] == "show":
            fields = [line for line in lines if not line.startswith(("phases ", "restored in "))]
            assert len(fields) == 14, lines  # one line per field: the user's newline did not start another
            command = [line for line in lines if line.startswith("command ")]
            assert command and "fake-argv0 line1\\nline2 \\x1b[31mred" in command[0], lines
    wide = d.ctl("jobs", "-o", "wide", check=True).stdout
    assert "\\x1b]0;owned\\x07" in wide and "\\x9b6n" in wide and "\\u202eevil" in wide and "tab\\there\\r" in wide

    got = json.loads(d.ctl("--json", "jobs", check=True).stdout)
    assert [j["argv"] for j in got] == [argv, argv]  # exact, whatever it holds (nobody's job and root's)
    shown = json.loads(d.ctl("--json", "show", ck["id"], check=True).stdout)
    # (a checkpoint's argv is the process's /proc cmdline, read by psutil in text mode: a "\r" comes back "\n")
    assert shown["argv"][-len(EVIL):-1] == EVIL[:-1] and shown["argv"][-1].startswith("tab\there")
    yaml = d.ctl("-o", "yaml", "jobs", check=True).stdout
    _no_raw_control(yaml)
