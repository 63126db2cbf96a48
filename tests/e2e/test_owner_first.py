"""Owner checks come first: another uid naming root's job, as uid 65534 over the real socket, learns neither
its pid nor its state (running, ended, parked or not) before it is refused."""

from __future__ import annotations

import json
import re

from tests.helpers import NOBODY, DaemonProc, guard_table, wait_for


def _refusal(d: DaemonProc, *args: str) -> dict[str, object]:
    r = d.ctl("--json", *args, user=NOBODY)
    assert r.returncode != 0, r.stdout
    err: dict[str, object] = json.loads(r.stderr)["error"]
    return err


def _says_nothing_of(err: dict[str, object], pid: int, *words: str) -> None:
    msg = str(err["message"])
    assert not re.search(rf"\b{pid}\b", msg), msg
    for w in words:
        assert w not in msg, msg


def test_nobody_naming_roots_job_learns_neither_its_pid_nor_its_state(open_daemon: DaemonProc, jobs_to_kill):
    with open_daemon.client() as c:
        job = c.run(["/bin/sleep", "120"], name="roots")
    jobs_to_kill.append(int(job.pid))
    for args in (("checkpoint", job.id), ("migrate", job.id, "--to", "127.0.0.1:9")):
        err = _refusal(open_daemon, *args)
        assert err["code"] == "PERMISSION_DENIED", (args, err)
        _says_nothing_of(err, int(job.pid), "running")
    open_daemon.ctl("kill", job.id, check=True)
    # Ended now: the refusal is the same as while it ran (nothing says "not running").
    for args in (("checkpoint", job.id), ("migrate", job.id, "--to", "127.0.0.1:9")):
        err = _refusal(open_daemon, *args)
        assert err["code"] == "PERMISSION_DENIED", (args, err)
        _says_nothing_of(err, int(job.pid), "running", "ended")


def test_nobody_resuming_roots_guarded_job_that_is_not_parked_learns_not_its_state(open_daemon: DaemonProc,
                                                                                    jobs_to_kill):
    r = open_daemon.ctl("--json", "run", "--priority", "5", "--name", "guarded", "--", "/bin/sleep", "120",
                        check=True)
    job = json.loads(r.stdout)
    jobs_to_kill.append(int(job["pid"]))
    wait_for(lambda: job["job"] in guard_table(open_daemon.state), 10, what="the guard to adopt it")
    err = _refusal(open_daemon, "resume", job["job"])
    assert err["code"] == "PERMISSION_DENIED", err
    _says_nothing_of(err, int(job["pid"]), "running", "not parked")
    # Its owner is told the state.
    r = open_daemon.ctl("--json", "resume", job["job"])
    assert json.loads(r.stderr)["error"]["code"] == "FAILED_PRECONDITION" and "running" in r.stderr
