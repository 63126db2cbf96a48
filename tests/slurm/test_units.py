"""The Slurm integration's pure parts: scontrol parsing, the requeue/cancel decision, the log relay."""

from __future__ import annotations

import io
import subprocess
from pathlib import Path

import pytest

from memsnap.slurm.env import JobInfo, SlurmJob, classify, parse_show_job, requeue, restart_count
from memsnap.slurm.relay import EXIT_MARKER, LogRelay, unwrap, wrap

# Seen on Slurm 22.05 right after the signal reached the batch shell.
REQUEUED = ("JobId=11 JobName=exp.sh UserId=root(0) JobState=COMPLETING Reason=None Dependency=(null) "
            "Requeue=1 Restarts=1 BatchFlag=1 ExitCode=0:0 RunTime=00:00:00 SubmitTime=2026-11-30T00:55:23 "
            "StartTime=2026-11-30T00:55:27 EndTime=Unknown Deadline=N/A")
CANCELLED = ("JobId=10 JobName=exp.sh JobState=COMPLETING Reason=None Requeue=1 Restarts=0 ExitCode=0:0 "
             "RunTime=00:00:03 StartTime=2026-11-30T00:55:24 EndTime=2026-11-30T00:55:27 Deadline=N/A")
PENDING = "JobId=11 JobState=PENDING Reason=BeginTime Restarts=1 EndTime=Unknown"
RUNNING = "JobId=12 JobState=RUNNING Reason=None Restarts=0 EndTime=Unknown"
TIMEOUT = "JobId=13 JobState=TIMEOUT Reason=TimeLimit Restarts=0 EndTime=2026-11-30T01:00:00"


def test_parse_show_job():
    info = parse_show_job(REQUEUED)
    assert info == JobInfo(state="COMPLETING", restarts=1, end_time="Unknown", reason="None")


@pytest.mark.parametrize("line,known,fate", [
    (REQUEUED, 0, "requeue"),      # the launcher: Restarts went up under it
    (REQUEUED, None, "requeue"),   # the epilog: COMPLETING with no end time
    (CANCELLED, 0, "final"),
    (CANCELLED, None, "final"),
    (PENDING, None, "requeue"),
    (RUNNING, 0, "running"),
    (TIMEOUT, 0, "final"),
])
def test_classify(line, known, fate):
    assert classify(parse_show_job(line), known) == fate


def test_classify_forgotten_job_is_final():
    assert classify(None) == "final"


def test_restart_count_and_job_from_env():
    assert restart_count({}) == 0
    assert restart_count({"SLURM_RESTART_COUNT": "2"}) == 2
    assert restart_count({"SLURM_JOB_RESTART_COUNT": "3"}) == 3
    assert SlurmJob.from_environ({}) is None
    job = SlurmJob.from_environ({"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"})
    assert job is not None and job.key == "slurm-77" and job.restart_count == 1


def _relay(chunks: list[bytes], tmp_path) -> tuple[bytes, int | None]:
    log = tmp_path / "job.log"
    log.write_bytes(b"")
    out = io.BytesIO()
    relay = LogRelay(str(log), 0, out, lambda m: None)
    for c in chunks:
        with open(log, "ab") as f:
            f.write(c)
        relay.pump()
    relay.finish()
    return out.getvalue(), relay.exit_status


def test_relay_strips_the_exit_marker_even_split_across_reads(tmp_path):
    m = EXIT_MARKER
    text, status = _relay([b"tick 1\n", b"tick 2\n" + m[:5], m[5:] + b"4", b"2\n"], tmp_path)
    assert text == b"tick 1\ntick 2\n" and status == 42


def test_relay_keeps_a_partial_last_line_and_lookalikes(tmp_path):
    text, status = _relay([b"no newline" + EXIT_MARKER + b"0\n"], tmp_path)
    assert text == b"no newline" and status == 0
    text, status = _relay([b"\x1e not the marker\n", b"\x1ememsnap"], tmp_path)
    assert text == b"\x1e not the marker\n\x1ememsnap" and status is None


def test_relay_from_an_offset(tmp_path):
    log = tmp_path / "job.log"
    log.write_bytes(b"old output\nnew output\n")
    out = io.BytesIO()
    relay = LogRelay(str(log), len(b"old output\n"), out, lambda m: None)
    relay.finish()
    assert out.getvalue() == b"new output\n"


def test_relay_warns_once_about_an_unreadable_log(tmp_path):
    warnings: list[str] = []
    relay = LogRelay(str(tmp_path / "missing.log"), 0, io.BytesIO(), warnings.append)
    relay.pump()
    relay.pump()
    assert len(warnings) == 1 and "missing.log" in warnings[0]


@pytest.mark.parametrize("argv,status", [(["sh", "-c", "echo out; exit 5"], 5), (["true"], 0),
                                         (["/nonexistent/cmd"], 127)])
def test_wrapper_reports_the_exit_status(tmp_path, argv, status):
    log = tmp_path / "w.log"
    with open(log, "wb") as f:
        subprocess.run(wrap(argv), stdout=f, stderr=subprocess.STDOUT, check=False)
    out = io.BytesIO()
    relay = LogRelay(str(log), 0, out, lambda m: None)
    relay.finish()
    assert relay.exit_status == status
    assert EXIT_MARKER not in out.getvalue()
    assert unwrap(wrap(argv)) == argv and unwrap(argv) == argv


def _fake_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_requeue: str, show: str) -> None:
    """An scontrol on PATH: `requeue` runs on_requeue (shell), `-o show job` prints show."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(f"#!/bin/sh\nif [ \"$1\" = requeue ]; then {on_requeue}; fi\necho '{show}'\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")


@pytest.mark.parametrize("on_requeue,show,ok", [
    ("exit 0", RUNNING, True),
    # the requeue it asked for signalled the job's processes, scontrol too, before it exited: done all the same
    ("kill -TERM $$", REQUEUED, True),
    ("kill -TERM $$", RUNNING, False),  # killed, and the job runs on under the same restart count: not requeued
    ("echo 'Requested operation is presently disabled' >&2; exit 1", RUNNING, False),
])
def test_requeue_counts_a_scontrol_killed_by_the_requeue_it_asked_for_as_done(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_requeue: str, show: str, ok: bool) -> None:
    _fake_scontrol(tmp_path, monkeypatch, on_requeue, show)
    err = requeue("11", known_restarts=0)
    assert (err == "") is ok, err
