"""A job restored on the target for a move that the source never commits is killed there once
daemon.move_commit_timeout_s runs out (README: killed by the target after 120 s), with no restart."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import (
    assert_node_healthy,
    counter_job,
    migrate,
    secret_file,
    ticking_with,
    ticks,
    token_daemon,
    wait_for,
)

pytestmark = pytest.mark.usefixtures("no_copy_outlives_the_test")


def _other_pids(job: dict) -> set[int]:
    """Pids other than the source's that printed ticks to the job's log (a restored copy)."""
    return {t.hostpid for t in ticks(job["log"])} - {job["pid"]}


def test_a_restored_copy_the_source_never_commits_is_killed_when_the_commit_timeout_runs_out(jobs_to_kill,
                                                                                             tmp_path):
    token = secret_file(tmp_path / "node.token")
    # The source dies (kill -9) after the target replied that the job runs there, before it asks the
    # target to keep it: nobody will ever commit this move.
    src = token_daemon(tmp_path / "src", token, env={"MEMSNAP_FAILPOINTS": "before-commit-sent"})
    dst = token_daemon(tmp_path / "dst", token, more="move_commit_timeout_s = 5")
    try:
        src.start()
        dst.start()
        assert dst.proc is not None
        dst_pid = dst.proc.pid
        job = counter_job(src, jobs_to_kill, 16, "uncommitted")
        r = migrate(src, job["id"], "--to", dst.address)
        assert r.returncode != 0
        assert src.proc is not None and src.proc.wait(10) == 137
        # The copy on the target ran (it ticks under another pid) ...
        wait_for(lambda: _other_pids(job), 30, what="the target's copy to tick")
        others = _other_pids(job)
        assert len(others) == 1, others
        other = others.pop()
        jobs_to_kill.append(other)
        # ... until its commit timeout runs out: the same daemon (never restarted) kills it.
        wait_for(lambda: not Path(f"/proc/{other}").exists(), 60, what="the uncommitted copy to be killed")
        assert dst.proc.poll() is None and dst.proc.pid == dst_pid
        assert "the source never committed the move" in dst.log.read_text()
        with dst.client() as c:
            assert not [j for j in c.jobs() if j.running]
        # The source's copy, held by the move, runs on once its daemon is back.
        src.env = {}
        src.start()
        ticking_with(job, job["pid"], job["digest"], fresh=3)
        # ... and the image of the move that did not happen goes there, as in a rollback without a crash.
        assert_node_healthy(src, restorable=set())
    finally:
        src.cleanup()
        dst.cleanup()
