"""memsnap.resolve: which job a pid belongs to (the e2e tests cover real jobs in their own PID namespaces)."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass

import psutil

from memsnap.resolve import in_job_note, job_containing, note_for_target


@dataclass
class Job:
    id: str
    name: str
    pid: int
    pid_start: float
    ended: bool = False


def test_a_pid_below_a_job_root_without_a_namespace_of_its_own_is_found_by_ancestry():
    sh = subprocess.Popen(["/bin/sh", "-c", "sleep 30 & wait"])
    child = 0
    try:
        deadline = time.monotonic() + 10
        while not psutil.Process(sh.pid).children() and time.monotonic() < deadline:
            time.sleep(0.01)
        child = psutil.Process(sh.pid).children()[0].pid
        job = Job("job-1", "one", sh.pid, psutil.Process(sh.pid).create_time())
        other = Job("job-2", "two", 999_999, 0.0)
        assert job_containing([other, job], child) is job
        assert job_containing([other, job], sh.pid) is job
        assert job_containing([Job("job-1", "one", sh.pid, 0.0, ended=True)], child) is None
        # The host's namespace holds every process: a root there matches only its own descendants.
        assert job_containing([job], psutil.Process().pid) is None
        assert note_for_target([job], str(child), lambda j: True, "stopped") == \
            f"pid {child} is in job job-1 (one): stopped the whole job"
        assert note_for_target([job], str(child), lambda j: False, "stopped") == ""
    finally:
        for pid in (child, sh.pid):
            if pid:
                try:
                    psutil.Process(pid).kill()
                except psutil.Error:
                    pass
        sh.wait()


def test_the_note_is_said_only_for_a_pid_other_than_the_jobs_root():
    assert in_job_note("42", "job-a", "", 42, "checkpointed") == ""
    assert in_job_note("job-a", "job-a", "x", 42, "checkpointed") == ""
    assert in_job_note(" 43 ", "job-a", "", 42, "killed") == "pid 43 is in job job-a (job-a): killed the whole job"
    assert note_for_target([], "99999999999999", lambda j: True, "moved") == ""
