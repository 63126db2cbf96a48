"""`memsnapctl slurm run`: runs a batch job's workload under memsnap so that preemption checkpoints it
and a requeue restores it.

Life of a launcher (one per run of the Slurm job; `exec` it from the batch script):

1. Ask memsnapd for its status. If it does not answer, run the workload directly (a plain child
   process, no checkpoints) and say so on stderr: the job is never lost because of memsnapd.
2. First run (SLURM_RESTART_COUNT unset or 0): start the workload as a memsnap job named KEY
   (default slurm-<jobid>), wrapped in /bin/sh so that its exit status reaches the job log.
   Requeued run (SLURM_RESTART_COUNT > 0): restore KEY's latest restorable checkpoint instead
   (with no tier copy here, it resumes at once and pages in from the store); with no checkpoint, start afresh.
3. Relay the job log to stdout (so the Slurm output file shows the workload's output), checkpoint
   every --interval seconds if asked (without stopping), and wait for the workload to end.
4. On SIGTERM ask slurmctld what is happening: a requeue (preemption, `scontrol requeue`) -> checkpoint
   with stop, wait until durable when the daemon has a store (at most the grace budget), exit 0;
   a real end (scancel, time limit) -> stop the workload (SIGTERM, then SIGKILL) and exit.
   SIGUSR1 (e.g. `--signal=B:USR1@120`): checkpoint with stop, then requeue the job ourselves.
   SIGUSR2: checkpoint now and keep running. SIGINT: stop the workload. SIGCONT/SIGHUP: ignored.
"""

from __future__ import annotations

import collections
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import BinaryIO, TextIO

import grpc
import psutil

from memsnap import proc
from memsnap.cli_fmt import printable
from memsnap.client import LONG_S, QUICK_S, ClientError, MemsnapClient, Target
from memsnap.slurm import env as slurm_env
from memsnap.slurm.direct import run_direct
from memsnap.slurm.env import SlurmJob
from memsnap.slurm.relay import LogRelay, empty_output, file_size, log_chain, wrap
from memsnap.v1 import memsnap_pb2 as pb

DUMPING = pb.CHECKPOINT_STATE_DUMPING
STAGED = pb.CHECKPOINT_STATE_STAGED
DRAINING = pb.CHECKPOINT_STATE_DRAINING
DURABLE = pb.CHECKPOINT_STATE_DURABLE
FAILED = pb.CHECKPOINT_STATE_FAILED
RESTORABLE = (STAGED, DRAINING, DURABLE)
STATE_NAMES = {DUMPING: "dumping", STAGED: "staged", DRAINING: "draining", DURABLE: "durable",
               FAILED: "failed"}

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT, signal.SIGHUP)
POLL_S = 0.2
# Left for exiting after the work is done, out of the grace budget.
MARGIN_S = 3.0
# How long a workload may take to end on SIGTERM before it gets SIGKILL.
TERM_WAIT_S = 10.0
# How long a workload that vanished without an exit status may take to show up as parked by the guard.
PARK_WAIT_S = 30.0
# Exit status when the workload ended but nothing told us how (see docs/slurm.md).
UNKNOWN_STATUS = 1


class DaemonDown(Exception):
    """memsnapd stopped answering; fall back to running the workload directly."""


@dataclass
class Options:
    """What `memsnapctl slurm run` was asked to do."""

    argv: list[str]
    target: Target
    key: str = ""
    interval: float = 0.0
    grace: float | None = None
    resume: bool = False
    # the memory guard's (memsnapctl run --memory-limit/--priority/--on-limit); 0/"" = none
    memory_limit: int = 0
    priority: int = 0
    critical: bool = False
    on_limit: str = ""


@dataclass
class Workload:
    """The memsnap job that runs the workload (fresh or restored)."""

    job_id: str
    pid: int
    pid_start: float
    log_path: str
    restored_from: str = ""


@dataclass
class _Signals:
    queue: collections.deque[int] = field(default_factory=collections.deque)

    def handler(self, signum: int, frame: FrameType | None) -> None:
        self.queue.append(signum)


class Launcher:
    """One run of a Slurm job: start or restore, relay, checkpoint on the way out."""

    def __init__(self, opts: Options, slurm: SlurmJob | None = None, out: BinaryIO | None = None,
                 err: TextIO | None = None, client_factory: Callable[[Target], MemsnapClient] | None = None,
                 ) -> None:
        self.opts = opts
        self.slurm = slurm
        self.key = opts.key or (slurm.key if slurm else "")
        if not self.key:
            raise ValueError("not inside a Slurm job (no SLURM_JOB_ID): pass --name KEY")
        self.out = out or sys.stdout.buffer
        self.err = err or sys.stderr
        self._client_factory = client_factory or (lambda t: MemsnapClient(t))
        self._signals = _Signals()
        self.store_ok = False
        self._lazy = False  # the last restore paged the job in lazily (from the store)
        self.grace_s = 30.0
        self.workload: Workload | None = None
        self.relay: LogRelay | None = None
        self.client: MemsnapClient | None = None
        self._output_was_empty = False

    # -- messages -------------------------------------------------------------------
    def note(self, msg: str) -> None:
        """A line on stderr (it lands in the Slurm output file), its controls escaped (it carries names, commands
        and the daemon's messages: a newline or an escape sequence in one must not forge or hide a line)."""
        self.err.write(f"memsnap-slurm: {printable(msg)}\n")
        self.err.flush()

    def warn(self, msg: str) -> None:
        """A warning on stderr."""
        self.note(f"warning: {msg}")

    # -- entry ------------------------------------------------------------------------
    def run(self) -> int:
        """Runs the workload to its end (or to a checkpoint); returns the exit status for Slurm."""
        for sig in HANDLED:
            signal.signal(sig, self._signals.handler)
        # Before we write anything: Slurm truncates the output file when it starts a requeued job.
        self._output_was_empty = empty_output(self.out)
        self.grace_s = self._grace()
        try:
            self.client = self._client_factory(self.opts.target)
            st = self.client.status(timeout=QUICK_S)
        except ClientError as exc:
            self.warn(f"memsnapd is not available ({exc.message}); running the workload directly, "
                      "without checkpoints")
            return run_direct(self.opts.argv, self._signals.queue, self.note, self.slurm)
        self.store_ok = st.store not in ("", "none")
        early = self._early_exit()
        if early is not None:
            return early
        try:
            self.workload = self._start()
        except DaemonDown as exc:
            self.warn(f"memsnapd could not run the workload ({exc}); running it directly, "
                      "without checkpoints")
            return run_direct(self.opts.argv, self._signals.queue, self.note, self.slurm)
        try:
            return self._loop()
        finally:
            if self.client is not None:
                self.client.close()

    def _grace(self) -> float:
        if self.opts.grace is not None:
            return max(1.0, self.opts.grace)
        kill_wait = slurm_env.kill_wait() if self.slurm else None
        return float(kill_wait) if kill_wait else 30.0

    def _early_exit(self) -> int | None:
        """A SIGTERM/SIGINT before anything was started: nothing to save, just go."""
        for sig in list(self._signals.queue):
            if sig in (signal.SIGTERM, signal.SIGINT):
                self.note("signalled before the workload started; exiting without starting it")
                return 128 + sig
        return None

    def _c(self) -> MemsnapClient:
        assert self.client is not None
        return self.client

    # -- start: restore or launch ------------------------------------------------------
    def _start(self) -> Workload:
        restarted = self.slurm is not None and self.slurm.restart_count > 0
        w: Workload | None = None
        if restarted:
            self._rescue_orphans()
        if restarted or self.opts.resume:
            w = self._restore()
        elif self.slurm is not None and self.key == self.slurm.key:
            self._drop_stale()
        if w is None:
            w = self._launch()
        return w

    def _launch(self) -> Workload:
        env = {k: v for k, v in os.environ.items() if k != "MEMSNAP_SOCKET"}
        try:
            o = self.opts
            job = self._c().run(wrap(o.argv), name=self.key, cwd=os.getcwd(), env=env, timeout=60.0,
                                memory_limit=o.memory_limit, priority=o.priority, critical=o.critical,
                                on_limit=o.on_limit if (o.memory_limit or o.priority or o.critical) else "")
        except ClientError as exc:
            raise DaemonDown(f"RunJob: {exc.message}") from exc
        w = Workload(job_id=job.id, pid=int(job.pid), pid_start=_start_time(int(job.pid)),
                     log_path=job.log_path)
        self.relay = LogRelay(w.log_path, 0, self.out, self.warn)
        self.note(f"started {' '.join(self.opts.argv)} as memsnap job {job.id} ({self.key}, pid {w.pid})")
        return w

    def _rescue_orphans(self) -> None:
        """A workload of an earlier run that still runs lost its launcher (SIGKILLed before it could
        checkpoint, and no epilog cleaned up). Slurm starts a run only after the previous one ended,
        so it is an orphan: checkpoint it with stop (its state is the newest there is), else kill it.
        Either way it must not run on beside the restored copy."""
        try:
            orphans = [j for j in self._c().jobs() if j.name == self.key and j.running]
        except ClientError as exc:
            raise DaemonDown(exc.message) from exc
        for j in orphans:
            self.warn(f"memsnap job {j.id} (pid {j.pid}) of an earlier run still runs; checkpointing it")
            try:
                ck = self._c().checkpoint(j.id, stop=True, name=self.key, timeout=LONG_S)
                self._report(ck)
                continue
            except ClientError as exc:
                self.warn(f"checkpoint of {j.id} failed ({exc.message}); killing it")
            if proc.alive(int(j.pid)):
                proc.kill_tree(int(j.pid))

    def _previous_log(self) -> str:
        try:
            named = [j for j in self._c().jobs() if j.name == self.key]
        except ClientError:
            return ""
        return max(named, key=lambda j: j.started_unix_ms).log_path if named else ""

    def _restore(self) -> Workload | None:
        prev_log = self._previous_log()
        before = file_size(prev_log)
        replay = self._output_was_empty
        self._output_was_empty = False  # a second restore (after a failed self-requeue) must not replay
        t0 = time.monotonic()
        try:
            r = self._resume_parked() or self._restore_newest()
        except ClientError as exc:
            if exc.code == grpc.StatusCode.NOT_FOUND:
                self.note(f"no checkpoint of {self.key} yet: starting from the beginning")
                return None
            if exc.code == grpc.StatusCode.UNAVAILABLE:
                raise DaemonDown(exc.message) from exc
            self.warn(f"restore of {self.key} failed: {exc.message}")
            r2 = self._restore_older(exc.message)
            if r2 is None:
                self.warn(f"no checkpoint of {self.key} could be restored: starting from the beginning")
                return None
            r = r2
        w = Workload(job_id=r.job.id, pid=int(r.pid), pid_start=_start_time(int(r.pid)),
                     log_path=r.job.log_path, restored_from=r.job.restored_from)
        offset = 0 if replay or w.log_path != prev_log else before
        if replay and w.log_path != prev_log:
            for earlier in log_chain(prev_log, w.log_path):  # each restore logs to a file of its own
                LogRelay(earlier, 0, self.out, self.warn).finish()
        self.relay = LogRelay(w.log_path, offset, self.out, self.warn)
        where = ("from the store, paging in lazily" if self._lazy else "fetched from the store") if r.from_store \
            else "from the memory tier"
        self.note(f"restored {self.key} from checkpoint {w.restored_from} ({where}) as memsnap job "
                  f"{r.job.id} (pid {w.pid}) in {time.monotonic() - t0:.1f} s")
        return w

    def _resume_parked(self) -> pb.RestoreResponse | None:
        """A run requeued after the memory guard parked the workload on this node: resume it through the guard,
        into its memory cgroup, with this run's --memory-limit (0: the one it had). None when nothing of KEY is
        parked here (a plain restore follows: another node, or no guard)."""
        try:
            return self._c().resume_job(self.key, memory_limit=self.opts.memory_limit, timeout=LONG_S)
        except ClientError as exc:
            if exc.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
                            grpc.StatusCode.UNIMPLEMENTED):
                return None
            raise

    def _restore_newest(self) -> pb.RestoreResponse:
        """With no copy in this node's tier (requeued elsewhere, or evicted), pages in from the store."""
        try:
            mine = [c for c in self._mine() if c.state in RESTORABLE]
        except ClientError:
            mine = []
        newest = max(mine, key=lambda c: (c.created_unix_ms, c.id), default=None)
        self._lazy = newest is None or not newest.in_tier
        try:
            return self._c().restore(self.key, lazy=self._lazy, timeout=LONG_S)
        except ClientError as exc:  # (a node without userfaultfd)
            if not self._lazy or exc.code != grpc.StatusCode.FAILED_PRECONDITION or "lazily" not in exc.message:
                raise
        self._lazy = False
        return self._c().restore(self.key, timeout=LONG_S)

    def _restore_older(self, failed_msg: str) -> pb.RestoreResponse | None:
        """Tries the key's older checkpoints, newest first, skipping the one that just failed."""
        try:
            cands = [c for c in self._mine() if c.state in RESTORABLE and c.id not in failed_msg]
        except ClientError:
            return None
        for c in sorted(cands, key=lambda c: (c.created_unix_ms, c.id), reverse=True)[:2]:
            try:
                return self._c().restore(c.id, timeout=LONG_S)
            except ClientError as exc:
                self.warn(f"restore of older checkpoint {c.id} failed: {exc.message}")
        return None

    def _mine(self) -> list[pb.CheckpointInfo]:
        return [c for c in self._c().list() if c.name == self.key]

    def _drop_stale(self) -> None:
        """A first run finds checkpoints of its own key: an earlier job had the same id (ids restart
        when slurmctld's state is wiped). They must not be restored into this job later."""
        try:
            stale = [c for c in self._mine() if c.state != DUMPING]
        except ClientError:
            return
        if stale:
            self.warn(f"removing {len(stale)} stale checkpoint(s) of {self.key} left by an earlier job "
                      "with the same id")
        for c in stale:
            try:
                self._c().delete(c.id)
            except ClientError as exc:
                self.warn(f"could not delete stale checkpoint {c.id}: {exc.message}")

    # -- main loop ----------------------------------------------------------------------
    def _loop(self) -> int:
        next_ckpt = time.monotonic() + self.opts.interval if self.opts.interval > 0 else float("inf")
        while True:
            assert self.relay is not None
            self.relay.pump()
            while self._signals.queue:
                rc = self._on_signal(self._signals.queue.popleft())
                if rc is not None:
                    return rc
            if not self._alive():
                parked = self._parked_after_exit()
                return self._requeue_parked(parked) if parked else self._ended()
            if time.monotonic() >= next_ckpt:
                self._periodic()
                next_ckpt = time.monotonic() + self.opts.interval
            time.sleep(POLL_S)

    def _guard_state(self) -> tuple[str, str]:
        """(guard state, parked reason) of the workload's job; ("", "") when it is not guarded or unknown."""
        w = self.workload
        try:
            rows = self._c().jobs()
        except (ClientError, DaemonDown):
            return "", ""
        j = next((r for r in rows if w is not None and r.id == w.job_id), None)
        return (j.guard_state, j.parked_reason) if j is not None else ("", "")

    def _parked_after_exit(self) -> str:
        """Why the guard parked the workload that just went away, or "" if it ended by itself. A park kills
        the dumped tree before the guard records it parked, so a workload gone without an exit status (its
        wrapper was killed too) is given PARK_WAIT_S for that record to appear."""
        assert self.relay is not None
        self.relay.pump()
        if self.relay.exit_status is not None:
            return ""
        deadline = time.monotonic() + PARK_WAIT_S
        while True:
            state, reason = self._guard_state()
            if state == "parked":
                return reason or "parked"
            if state != "running" or time.monotonic() > deadline:  # not guarded, or ended/killed
                return ""
            time.sleep(POLL_S)

    def _requeue_parked(self, why: str) -> int:
        """A parked workload goes back to the scheduler, which can place it where memory is free; the next
        run restores it (the checkpoint says it was parked, so it runs on at once)."""
        if self.relay is not None:
            self.relay.finish()
        if self.slurm is not None:
            err = slurm_env.requeue(self.slurm.job_id, self.slurm.restart_count)
            if not err:
                self.note(f"the memory guard parked {self.key} ({why}); requeued Slurm job {self.slurm.job_id}")
                return 0
            self.warn(f"the memory guard parked {self.key} ({why}) and scontrol requeue failed ({err})")
        w = self.workload
        self.warn(f"the workload stays parked: memsnapctl resume {w.job_id if w else self.key}")
        return 1

    def _alive(self) -> bool:
        w = self.workload
        return w is not None and proc.alive(w.pid, w.pid_start)

    def _ended(self) -> int:
        assert self.relay is not None
        self.relay.finish()
        status = self.relay.exit_status
        if status is None:
            self.warn(f"the workload ended but its exit status is unknown (it was killed from outside "
                      f"memsnap's wrapper); exiting {UNKNOWN_STATUS}")
            return UNKNOWN_STATUS
        self.note(f"the workload exited with status {status}")
        return status

    def _on_signal(self, sig: int) -> int | None:
        deadline = time.monotonic() + max(1.0, self.grace_s - MARGIN_S)
        if sig == signal.SIGTERM:
            fate: slurm_env.Fate = "unknown"
            if self.slurm is not None:
                fate = slurm_env.job_fate(self.slurm.job_id, self.slurm.restart_count)
            if fate == "final":
                self.note("SIGTERM: the job is cancelled or over (not requeued); stopping the workload")
                return self._terminate(128 + signal.SIGTERM)
            why = {"requeue": "the job is being requeued (preemption or scontrol requeue)",
                   "running": "SIGTERM while the job still runs", "unknown": "SIGTERM"}[fate]
            self.note(f"{why}: checkpointing {self.key} before exiting")
            if self._checkpoint_stop(deadline):
                return 0 if fate == "requeue" else 128 + signal.SIGTERM
            return self._terminate(1)
        if sig == signal.SIGINT:
            self.note("SIGINT: stopping the workload")
            return self._terminate(128 + signal.SIGINT)
        if sig == signal.SIGUSR1:
            return self._checkpoint_and_requeue(deadline)
        if sig == signal.SIGUSR2:
            self.note(f"SIGUSR2: checkpointing {self.key} (the workload keeps running)")
            self._snapshot()
            return None
        return None  # SIGCONT comes with every Slurm signal; SIGHUP means nothing here.

    # -- checkpoints ---------------------------------------------------------------------
    def _checkpoint_stop(self, deadline: float) -> bool:
        """Checkpoint with stop, durable if the daemon has a store; True once the workload is saved
        (or being saved by memsnapd) and must not be killed."""
        w = self.workload
        assert w is not None
        budget = max(2.0, deadline - time.monotonic())
        t0_ms = int(time.time() * 1000) - 1000
        try:
            ck = self._c().checkpoint(w.job_id, stop=True, wait_durable=self.store_ok, name=self.key,
                                      timeout=budget)
        except ClientError as exc:
            late = self._newest_since(t0_ms) if exc.code in (
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.CANCELLED) else None
            if late is None or late.state == FAILED:
                self.warn(f"checkpoint of {self.key} failed: {exc.message}")
                return False
            if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                self.warn(f"grace budget of {budget:.0f} s spent before checkpoint {late.id} became durable; "
                          "memsnapd carries on without us")
            ck = late
        self._report(ck)
        if ck.state == FAILED:
            return not self._alive()
        if self.relay is not None:
            self.relay.finish()
        return True

    def _newest_since(self, t0_ms: int) -> pb.CheckpointInfo | None:
        try:
            cands = [c for c in self._mine() if c.created_unix_ms >= t0_ms]
        except ClientError:
            return None
        return max(cands, key=lambda c: (c.created_unix_ms, c.id)) if cands else None

    def _report(self, ck: pb.CheckpointInfo) -> None:
        state = STATE_NAMES.get(ck.state, "?")
        line = (f"checkpoint {ck.id} is {state}: {ck.size_bytes / (1 << 20):.1f} MiB, "
                f"frozen {ck.frozen_ms} ms, dump {ck.dump_ms} ms")
        if ck.state == FAILED:
            self.warn(f"checkpoint {ck.id} failed: {ck.last_error}")
            return
        if ck.state == DUMPING:
            line = (f"checkpoint {ck.id} is still being dumped; memsnapd finishes it and then stops "
                    "the workload")
        elif self.store_ok and ck.state != DURABLE:
            line += " (not durable yet: memsnapd keeps draining it to the store)"
        elif not self.store_ok:
            line += " (memsnapd has no store: it lives in this node's memory tier only)"
        self.note(line)

    def _snapshot(self) -> None:
        w = self.workload
        assert w is not None
        try:
            ck = self._c().checkpoint(w.job_id, stop=False, name=self.key, timeout=LONG_S)
        except ClientError as exc:
            self.warn(f"checkpoint of {self.key} failed (the workload runs on): {exc.message}")
            return
        self._report(ck)
        self._prune(ck.id)

    def _periodic(self) -> None:
        if self._alive():
            self._snapshot()

    def _prune(self, newest: str) -> None:
        """Keeps the newest checkpoint and the newest durable one; deletes older settled ones."""
        try:
            mine = self._mine()
        except ClientError:
            return
        durable = [c for c in mine if c.state == DURABLE]
        keep = {newest}
        if durable:
            keep.add(max(durable, key=lambda c: (c.created_unix_ms, c.id)).id)
        for c in mine:
            if c.id not in keep and c.state in (STAGED, DURABLE):
                try:
                    self._c().delete(c.id)
                except ClientError as exc:
                    self.warn(f"could not delete old checkpoint {c.id}: {exc.message}")

    def _checkpoint_and_requeue(self, deadline: float) -> int | None:
        """SIGUSR1: the job is about to be preempted or hit its time limit."""
        self.note(f"SIGUSR1: checkpointing {self.key} and requeueing the job")
        if not self._checkpoint_stop(deadline):
            if not self._alive():
                return self._ended()
            self.warn("the workload runs on; Slurm's next signal decides")
            return None
        if self.slurm is None:
            return 0
        err = slurm_env.requeue(self.slurm.job_id, self.slurm.restart_count)
        if not err:
            self.note(f"requeued Slurm job {self.slurm.job_id}; the next run restores {self.key}")
            return 0
        # Not requeueable (--no-requeue, JobRequeue=0...): carry on from the checkpoint right here.
        self.warn(f"scontrol requeue {self.slurm.job_id} failed ({err}); restoring {self.key} to carry on")
        try:
            w = self._restore()
        except DaemonDown:
            w = None
        if w is None:
            self.warn("could not restore; the job ends here and its checkpoints are kept until the epilog")
            return 1
        self.workload = w
        return None

    # -- stopping --------------------------------------------------------------------------
    def _terminate(self, default_status: int) -> int:
        """SIGTERM to the workload (not the wrapper), SIGKILL after a while; its status if known."""
        w = self.workload
        assert w is not None and self.relay is not None
        if self._alive():
            try:
                kids = psutil.Process(w.pid).children(recursive=True)
            except psutil.Error:
                kids = []
            for p in kids:
                try:
                    p.send_signal(signal.SIGTERM)
                except psutil.Error:
                    pass
            deadline = time.monotonic() + min(TERM_WAIT_S, max(1.0, self.grace_s - MARGIN_S))
            while self._alive() and time.monotonic() < deadline:
                self.relay.pump()
                time.sleep(0.05)
            if self._alive():
                self.note("the workload ignored SIGTERM; killing it")
                proc.kill_tree(w.pid)
        self.relay.finish()
        status = self.relay.exit_status
        return status if status is not None else default_status


def _start_time(pid: int) -> float:
    try:
        return proc.start_time(pid)
    except proc.ProcessNotFound:
        return 0.0
