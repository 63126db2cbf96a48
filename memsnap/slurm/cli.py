"""`memsnapctl slurm ...`: the job-side launcher and the epilog's cleanup (docs/slurm.md)."""

from __future__ import annotations

import sys
from dataclasses import asdict
from typing import TYPE_CHECKING

import click

from memsnap.cli_fmt import printable
from memsnap.client import ClientError, Target
from memsnap.slurm import hooks
from memsnap.slurm.env import SlurmJob
from memsnap.slurm.launcher import Launcher, Options

if TYPE_CHECKING:
    from memsnap.cli import Ctx


@click.group("slurm")
def slurm_group() -> None:
    """Slurm integration: checkpoint on preemption, restore on requeue (docs/slurm.md)."""


@slurm_group.command("run", context_settings={"ignore_unknown_options": True,
                                              "allow_interspersed_args": False})
@click.option("--interval", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="also checkpoint every SECONDS (the workload keeps running); 0: only on preemption")
@click.option("--name", default="", help="memsnap key of this job (default slurm-$SLURM_JOB_ID)")
@click.option("--grace", type=click.FloatRange(min=1), default=None, envvar="MEMSNAP_SLURM_GRACE",
              help="seconds the launcher has after SIGTERM/SIGUSR1 before Slurm kills it "
                   "(default: KillWait from slurm.conf)")
@click.option("--resume", is_flag=True, help="restore KEY's latest checkpoint even on a first run")
@click.option("--socket", default="", help="memsnapd socket (overrides the global --socket/MEMSNAP_SOCKET)")
@click.option("--memory-limit", default="", help="the workload's own memory cgroup with this limit (e.g. 4G); "
                                               "at the limit memsnapd parks it and the launcher requeues the job")
@click.option("--priority", default="0", help="node pressure parks the lowest first: -1000..1000, or critical")
@click.option("--on-limit", type=click.Choice(["park", "kill"]), default="park", show_default=True,
              help="at its memory limit: park it (and requeue the Slurm job), or let it be killed")
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_obj
def run_cmd(obj: Ctx, interval: float, name: str, grace: float | None, resume: bool, socket: str,
            memory_limit: str, priority: str, on_limit: str, argv: tuple[str, ...]) -> None:
    """Run CMD in a batch script: memsnapctl slurm run [OPTIONS] -- CMD ARGS...

    Use `exec` so that Slurm's signals reach the launcher itself. On a requeue (preemption,
    scontrol requeue) the workload is checkpointed; the requeued run restores it. With --memory-limit, a
    workload that reaches it is parked by memsnapd and the job requeued; the requeued run resumes it with
    that run's --memory-limit.
    """
    from memsnap.cli import guard_args

    target = Target(socket=socket) if socket else obj.target
    guarded = guard_args(memory_limit, priority, on_limit)
    try:
        launcher = Launcher(Options(argv=list(argv), target=target, key=name, interval=interval, grace=grace,
                                    resume=resume, **guarded), SlurmJob.from_environ())
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    sys.exit(launcher.run())


@slurm_group.command("epilog")
@click.option("--job-id", envvar="SLURM_JOB_ID", required=True, help="Slurm job id (env SLURM_JOB_ID)")
@click.option("--name", default="", help="memsnap key (default slurm-JOBID)")
@click.option("--keep", is_flag=True, envvar="MEMSNAP_EPILOG_KEEP",
              help="keep the checkpoints of jobs that really ended")
@click.option("--dump-wait", type=click.FloatRange(min=0), default=120.0, show_default=True,
              help="seconds to wait for a checkpoint that is still being dumped")
@click.option("--rescue-timeout", type=click.FloatRange(min=1), default=120.0, show_default=True,
              help="deadline of the rescue checkpoint of an orphaned workload on requeue")
@click.pass_obj
def epilog_cmd(obj: Ctx, job_id: str, name: str, keep: bool, dump_wait: float, rescue_timeout: float) -> None:
    """Clean up after a run of a Slurm job (called by scripts/slurm/epilog.sh)."""
    try:
        with obj.client() as c:
            res = hooks.epilog(c, job_id, key=name, keep=keep, dump_wait=dump_wait,
                               rescue_timeout=rescue_timeout)
    except ClientError as exc:
        click.echo(f"memsnapctl: {exc.code.name}: {printable(exc.message)}", err=True)
        sys.exit(1)
    obj.emit(asdict(res), res.summary())


def register(cli: click.Group) -> None:
    """Adds `memsnapctl slurm` (called by memsnap.cli.main)."""
    cli.add_command(slurm_group)
