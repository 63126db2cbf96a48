"""memsnapctl pieces that need no daemon: option hoisting, formats, exit codes, start-up imports, error words."""

from __future__ import annotations

import grp
import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from memsnap import cli, cli_fmt
from memsnap.client import _socket_error
from memsnap.criulog import error_lines

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("args, want", [
    (["status", "--json"], ["--json", "status"]),
    (["list", "-o", "wide"], ["--output", "wide", "list"]),
    (["list", "-oyaml"], ["--output", "yaml", "list"]),
    (["show", "X", "--output=json"], ["--output", "json", "show", "X"]),
    (["run", "--json", "--", "cmd", "--json"], ["--json", "run", "--", "cmd", "--json"]),
    (["run", "--name", "n", "-o", "json", "--", "cmd", "-o", "x"],
     ["--output", "json", "run", "--name", "n", "--", "cmd", "-o", "x"]),
    (["run", "cmd", "--json"], ["run", "cmd", "--json"]),
    (["--socket", "/s", "run", "cmd", "--json"], ["--socket", "/s", "run", "cmd", "--json"]),
    (["slurm", "run", "--interval", "5", "cmd", "--json"], ["slurm", "run", "--interval", "5", "cmd", "--json"]),
])
def test_output_options_move_to_the_front_but_never_out_of_a_jobs_command(args, want):
    assert cli.hoist_output_options(args) == want


def test_exit_codes_differ_per_error_class():
    classes = ["NOT_FOUND", "PERMISSION_DENIED", "UNAVAILABLE", "DATA_LOSS", "RESOURCE_EXHAUSTED",
               "FAILED_PRECONDITION", "ABORTED", "INTERNAL", "USAGE"]
    codes = [cli.EXIT_CODES[c] for c in classes]
    assert len(set(codes)) == len(codes) and cli.EXIT_CODES["USAGE"] == 2 and 0 not in codes
    for code in set(codes):
        assert f"\n  {code} " in "\n" + cli.EXIT_HELP.replace("\b\n", "") or f"{code}  " in cli.EXIT_HELP


def test_help_does_not_import_grpc():
    code = ("import sys\nfrom memsnap import cli\ntry:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('GRPC' if 'grpc' in sys.modules else 'NOGRPC', file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
    assert r.stderr.strip().endswith("NOGRPC") and "Exit status:" in r.stdout and "migrate" in r.stdout


def test_python_m_runs_memsnapctl_and_importing_its_main_module_runs_nothing():
    # (tests/helpers.py imports every memsnap module, __main__ included, before it drops root)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", "import memsnap.cli.__main__", "status"], capture_output=True,
                       text=True, env=env)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    r = subprocess.run([sys.executable, "-m", "memsnap.cli", "no-such-command"], capture_output=True, text=True,
                       env=env)
    assert r.returncode == 2 and "No such command 'no-such-command'" in r.stderr


def test_yaml_output_of_nested_data():
    data = {"id": "ck-1", "size_bytes": 3, "in_tier": True, "argv": ["python", "x: y"], "gpus": [], "note": ""}
    assert cli_fmt.to_yaml(data) == "\n".join([
        "argv:", "  - python", '  - "x: y"', "gpus: []", "id: ck-1", "in_tier: true", 'note: ""', "size_bytes: 3"])
    assert cli_fmt.to_yaml([{"a": 1, "b": {"c": "2"}}]) == '- a: 1\n  b:\n    c: "2"'


def test_humanised_sizes_durations_and_ages():
    assert cli_fmt.human_bytes(263 << 20) == "263.0 MiB"
    assert [cli_fmt.human_ms(x) for x in (138, 2500, 125_000)] == ["138 ms", "2.5 s", "2m5s"]
    assert cli_fmt.age(1_000_000, now=1_000 + 3 * 3600) == "3h"


def test_progress_writes_plain_lines_off_a_terminal(tmp_path):
    out = open(tmp_path / "out", "w+")
    p = cli_fmt.Progress("ck-1", out, tty=False)
    for done in range(0, 101, 5):
        p.update(done, 100, "draining")
    p.update(100, 100, "durable")
    p.done()
    out.seek(0)
    text = out.read()
    assert "\r" not in text and len(text.splitlines()) <= 7 and text.splitlines()[-1].endswith("durable")
    assert "100.0%" in text.splitlines()[-1]


def test_errors_in_json_mode_are_json_on_stderr(capsys):
    with pytest.raises(SystemExit) as e:
        cli.fail("NOT_FOUND", "no checkpoint 'x'", "json")
    assert e.value.code == 3
    assert json.loads(capsys.readouterr().err) == {"error": {"code": "NOT_FOUND", "message": "no checkpoint 'x'",
                                                             "exit_code": 3}}


def test_a_socket_without_access_says_permission_denied_and_names_the_group(tmp_path):
    sock = tmp_path / "d.sock"
    sock.touch()
    err = _socket_error(str(sock), "failed to connect to all addresses; last error: UNKNOWN: "
                                   f"unix:{sock}: Permission denied")
    assert err.code == grpc.StatusCode.PERMISSION_DENIED
    assert f"permission denied on {sock}: ask to be added to group {grp.getgrgid(os.getgid()).gr_name}" \
        in err.message
    gone = _socket_error(str(tmp_path / "none.sock"), "failed to connect to all addresses")
    assert gone.code == grpc.StatusCode.UNAVAILABLE and "no memsnapd socket at" in gone.message


RESTORE_LOG = """\
(00.000146) Error (criu/util.c:1533): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted
(00.013210)      2: Error (criu/files-reg.c:2178): File var/lib/memsnap/jobs/job-1.log has bad size 156 (expect 117)
(00.013214)      2: Error (criu/files.c:1221): Unable to open fd=1 id=0x29
(00.013480)      1: Error (criu/cr-restore.c:1258): 2 exited, status=1
(00.020049) Error (criu/cr-restore.c:2320): Restoring FAILED.
"""


def test_criu_error_leads_with_the_decisive_line(tmp_path):
    log = tmp_path / "restore.log"
    log.write_text(RESTORE_LOG)
    lines = error_lines(log)
    assert "has bad size 156 (expect 117)" in lines[0]
    assert lines[-1] == "Error (criu/cr-restore.c:2320): Restoring FAILED." and len(lines) == 3


def test_man_page_is_generated_from_the_current_commands(tmp_path):
    subprocess.run([str(REPO / "scripts" / "gen-man.sh"), str(tmp_path / "memsnapctl.1")], check=True, cwd=REPO)
    fresh = (tmp_path / "memsnapctl.1").read_text()
    assert fresh == (REPO / "docs" / "memsnapctl.1").read_text(), "run scripts/gen-man.sh and commit docs/memsnapctl.1"
    for cmd in ("stop", "logs", "prune", "migrate", "slurm run"):
        assert f".SS memsnapctl {cmd}" in fresh


def test_slurm_install_hooks_puts_them_where_slurm_conf_points(tmp_path):
    conf = tmp_path / "slurm.conf"
    conf.write_text(f"ClusterName=c\nprolog={tmp_path}/hooks/pro.sh,/etc/other.sh  # ours first\n"
                    "#Epilog=/nowhere/epilog.sh\n")
    env_file = tmp_path / "etc" / "slurm-hooks.env"
    args = ["slurm", "install-hooks", "--slurm-conf", str(conf), "--env-file", str(env_file)]
    r = subprocess.run([sys.executable, "-m", "memsnap.cli", *args, "--dry-run"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
    assert f"would install {REPO}/scripts/slurm/prolog.sh -> {tmp_path}/hooks/pro.sh" in r.stdout
    assert not (tmp_path / "hooks").exists() and not env_file.exists()
    from memsnap.cli_slurm_hooks import conf_paths

    assert conf_paths(conf) == {"Prolog": f"{tmp_path}/hooks/pro.sh"}
    assert "add to" in r.stdout and "Epilog=/usr/local/lib/memsnap/slurm/epilog.sh" in r.stdout


def test_json_log_lines_carry_dict_arguments_as_json_not_reprs():
    import logging

    from memsnap.logs import JsonFormatter

    rec = logging.LogRecord("memsnap.daemon", logging.INFO, __file__, 1, "recovered %s", ({"failed_dumps": 0},),
                            None)
    line = json.loads(JsonFormatter().format(rec))
    assert line["msg"] == 'recovered {"failed_dumps": 0}' and line["args"] == [{"failed_dumps": 0}]


def test_follow_view_draws_a_bar_with_rate_and_eta_on_a_terminal(monkeypatch):
    """memsnap.cli_follow's display of a daemon's progress report, with a fake clock: one redrawn line on a terminal,
    with the phase's rate and ETA; a new phase starts its own rate."""
    import io
    import types

    from memsnap import cli_follow
    from memsnap.v1 import memsnap_pb2 as pb

    now = [100.0]
    clock = types.SimpleNamespace(monotonic=lambda: now[0])
    monkeypatch.setattr(cli_fmt, "time", clock)
    monkeypatch.setattr(cli_follow, "time", clock)
    out = io.StringIO()
    view = cli_follow._View("restoring ck-1", out, True, False, 99.0)
    mib = 1 << 20
    for t, done in ((100.0, 0), (101.0, 100 * mib), (102.0, 200 * mib)):
        now[0] = t
        view.show(pb.Progress(phase="fetch", done_bytes=done, total_bytes=400 * mib))
    frames = out.getvalue().split("\r")[1:]
    assert len(frames) == 3 and "\n" not in out.getvalue()
    assert "50.0% 200.0 MiB/400.0 MiB 100.0 MiB/s ETA 2.0 s fetch" in frames[-1], frames[-1]
    now[0] = 103.0
    view.show(pb.Progress(phase="restore"))
    assert out.getvalue().split("\r")[-1].startswith("restoring ck-1: restore ... ")
    view.done()
    assert out.getvalue().endswith("\n")
