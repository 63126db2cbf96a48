"""memsnapctl's job commands: run, jobs, logs, stop, kill, rm, prune and the memory guard's resume."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import click

from memsnap.cli.core import Ctx, Failure, command_of, duration_arg, handle_errors, job_dict, say_in_job
from memsnap.cli_fmt import age, human_bytes, human_ms, printable, table

if TYPE_CHECKING:
    from memsnap.client import MemsnapClient
    from memsnap.v1 import memsnap_pb2 as pb


@click.command("run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--name", default="", help="a name to find the job by")
@click.option("--own-proc/--host-proc", "own_proc", default=None,
              help="give the job its own /proc (a mount namespace; CUDA needs it), or the host's; "
                   "default: its own on a node with an NVIDIA GPU")
@click.option("--private-tmp/--shared-tmp", "private_tmp", default=None,
              help="give the job a /tmp of its own (its files travel in its checkpoints), or the host's "
                   "(files there are shared with everyone); default: the node's daemon.private_tmp (on)")
@click.option("--memory-limit", default="", help="its own memory cgroup with this limit, e.g. 256M, 4G")
@click.option("--priority", default="0", help="node pressure parks the lowest first: -1000..1000, or critical "
                                               "(never parked by node pressure)")
@click.option("--on-limit", type=click.Choice(["park", "kill"]), default="park", show_default=True,
              help="at its memory limit: checkpoint and stop it (resume later), or let it be killed")
@click.option("--keep-last", type=click.IntRange(0, 1_000_000), default=None, metavar="N",
              help="gc keeps its newest N checkpoints (and always its newest durable one)")
@click.option("--keep-within", default=None, metavar="DURATION",
              help="gc keeps its checkpoints younger than this, e.g. 30m, 2h, 7d")
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_obj
@handle_errors
def run_cmd(obj: Ctx, name: str, own_proc: bool | None, private_tmp: bool | None, memory_limit: str, priority: str,
            on_limit: str, keep_last: int | None, keep_within: str | None, argv: tuple[str, ...]) -> None:
    """Start CMD as a managed job in its own PID namespace: memsnapctl run [--name N] -- CMD ARGS..."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSNAP_SOCKET")}
    guarded = guard_args(memory_limit, priority, on_limit)
    if not obj.address:
        _check_command(argv[0], env.get("PATH", os.defpath))
    keep: dict[str, Any] = {"keep_last": keep_last, "keep_within_s": duration_arg(keep_within, "--keep-within")}
    with obj.client() as c:
        job = c.run(list(argv), name=name, cwd=os.getcwd(), env=env, own_proc=own_proc, private_tmp=private_tmp,
                    **guarded, **keep)
    obj.emit({"job": job.id, "pid": int(job.pid), "name": job.name, "log": job.log_path},
             f"started {job.id} ({job.name}) as pid {job.pid}; output: memsnapctl logs -f {job.id}")


def guard_args(memory_limit: str, priority: str, on_limit: str) -> dict[str, Any]:
    """The memory guard's options of `run` (and `slurm run`) as RunJob fields."""
    limit = _size_arg(memory_limit, "--memory-limit") if memory_limit else 0
    critical = priority.strip().lower() == "critical"
    try:
        prio = 0 if critical else int(priority)
    except ValueError:
        raise click.BadParameter(f"{priority!r} is not a number or critical", param_hint="--priority") from None
    return {"memory_limit": limit, "priority": prio, "critical": critical,
            "on_limit": on_limit if (limit or prio or critical) else ""}


def _check_command(exe: str, path: str) -> None:
    """Refuses a command that cannot start (the daemon runs it as the caller, with the caller's PATH and
    working directory, on this node), before a job is made of it."""
    import shutil

    if "/" in exe:
        full = os.path.abspath(exe)
        if not os.path.isfile(full):
            raise Failure("NOT_FOUND", f"{exe}: no such file")
        if not os.access(full, os.X_OK):
            raise Failure("PERMISSION_DENIED", f"{exe}: not executable")
    elif shutil.which(exe, path=path) is None:
        raise Failure("NOT_FOUND", f"{exe}: command not found in PATH ({path})")


@click.command("jobs")
@click.pass_obj
@handle_errors
def jobs_cmd(obj: Ctx) -> None:
    """Managed jobs (launched or restored by memsnap)."""
    with obj.client() as c:
        js = c.jobs()
    rows, wide = [], []
    for j in js:
        cmd = " ".join(command_of(list(j.argv)))
        state = j.guard_state if j.guard_state in ("parked", "resumed", "killed") else \
            "running" if j.running else "ended"
        row = [j.id, j.name, str(j.pid), state, age(j.started_unix_ms),
               j.moved_from or j.restored_from or "-"]  # (a moved job: where it came from, HOST/JOB)
        argv = command_of(list(j.argv))
        short = " ".join([os.path.basename(argv[0]), *argv[1:]]) if argv else ""
        rows.append([*row, short if len(short) <= 60 else short[:57] + "..."])
        wide.append([*row, str(j.owner_uid), j.log_path or "-", cmd])
    head = ["JOB", "NAME", "PID", "STATE", "AGE", "FROM"]
    obj.emit([job_dict(j) for j in js], table(rows, [*head, "COMMAND"]),
             table(wide, [*head, "UID", "LOG", "COMMAND"]))


@click.command("stop")
@click.argument("jobs", nargs=-1, required=True, metavar="JOB...")
@click.option("-t", "--timeout", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="seconds to wait after SIGTERM before SIGKILL")
@click.pass_obj
@handle_errors
def stop_cmd(obj: Ctx, jobs: tuple[str, ...], timeout: float) -> None:
    """Stop jobs: SIGTERM (passed on by the job's init), then SIGKILL after --timeout."""
    with obj.client() as c:
        for key in jobs:
            r = c.stop_job(key, timeout_s=timeout, timeout=timeout + 30)
            _emit_stopped(obj, r, "stopped", key)


@click.command("kill")
@click.argument("jobs", nargs=-1, required=True, metavar="JOB...")
@click.pass_obj
@handle_errors
def kill_cmd(obj: Ctx, jobs: tuple[str, ...]) -> None:
    """Kill jobs at once (SIGKILL to the whole tree)."""
    with obj.client() as c:
        for key in jobs:
            _emit_stopped(obj, c.stop_job(key, kill=True), "killed", key)


def _emit_stopped(obj: Ctx, r: pb.StopJobResponse, verb: str, key: str) -> None:
    j = r.job
    how = "killed after the timeout" if r.killed and verb == "stopped" else verb
    human = (f"{j.id} ({j.name}) {how} in {human_ms(r.stop_ms)}" if r.stop_ms or r.killed
             else f"{j.id} ({j.name}) was not running")
    d = {"job": j.id, "name": j.name, "pid": int(j.pid), "killed": r.killed, "stop_ms": int(r.stop_ms)}
    say_in_job(obj, d, key, j.id, j.name, int(j.pid), verb)
    obj.emit(d, human)


@click.command("rm")
@click.argument("jobs", nargs=-1, required=True, metavar="JOB...")
@click.option("-f", "--force", is_flag=True, help="kill a running job first")
@click.pass_obj
@handle_errors
def rm_cmd(obj: Ctx, jobs: tuple[str, ...], force: bool) -> None:
    """Forget ended jobs and remove their logs (logs a checkpoint still needs stay)."""
    with obj.client() as c:
        for key in jobs:
            j = c.delete_job(key, force=force)
            obj.emit({"removed": j.id, "name": j.name}, f"removed {j.id} ({j.name})")


@click.command("prune")
@click.option("--dry-run", is_flag=True, help="only list what would be removed")
@click.pass_obj
@handle_errors
def prune_cmd(obj: Ctx, dry_run: bool) -> None:
    """Remove ended jobs and failed checkpoints."""
    with obj.client() as c:
        r = c.prune(dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    lines = [f"{verb} job {j.id} ({j.name})" for j in r.jobs]
    lines += [f"{verb} checkpoint {k.id} (failed: {(k.last_error or '-')[:60]})" for k in r.checkpoints]
    lines.append(f"{verb} {len(r.jobs)} jobs and {len(r.checkpoints)} failed checkpoints, "
                 f"{human_bytes(r.log_bytes)} of logs")
    obj.emit({"dry_run": dry_run, "jobs": [j.id for j in r.jobs], "checkpoints": [k.id for k in r.checkpoints],
              "log_bytes": int(r.log_bytes)}, lines)


@click.command("logs")
@click.argument("job")
@click.option("-f", "--follow", is_flag=True, help="keep printing what the job writes until it ends")
@click.option("--tail", "tail_bytes", type=click.IntRange(min=0), default=0, metavar="BYTES",
              help="only the end of the log: its last BYTES, from the first whole line")
@click.pass_obj
@handle_errors
def logs_cmd(obj: Ctx, job: str, follow: bool, tail_bytes: int) -> None:
    """Print a job's output (stdout and stderr); -f follows it."""
    out = sys.stdout.buffer
    with obj.client() as c:
        try:
            for chunk in _log_chunks(c, job, follow, tail_bytes):
                out.write(chunk)
                out.flush()
        except KeyboardInterrupt:
            pass


def _log_chunks(c: MemsnapClient, job: str, follow: bool, tail_bytes: int) -> Iterator[bytes]:
    first = bool(tail_bytes)  # a tail starts mid-line: begin at the next whole line
    head = not tail_bytes  # memsnap's own header line ("# memsnap: restored from ..."): printed escaped
    for m in c.job_logs(job, follow=follow, tail_bytes=tail_bytes):
        data = m.data
        if first and data:
            first = False
            cut = data.find(b"\n")
            data = data[cut + 1:] if cut >= 0 else data
        if head and data:
            head = False
            line, nl, rest = data.partition(b"\n")
            if line.startswith(b"# memsnap: ") and nl:  # (the job's own output stays as the job wrote it)
                data = printable(line.decode("utf-8", "replace")).encode() + nl + rest
        if data:
            yield data


@click.command("resume")
@click.argument("job")
@click.option("--memory-limit", default="", help="a new memory limit for it, e.g. 1G (default: its old one)")
@click.pass_obj
@handle_errors
def resume_cmd(obj: Ctx, job: str, memory_limit: str) -> None:
    """Resume a job the memory guard parked (at its limit, or under node pressure)."""
    from memsnap.cli_follow import follow

    limit = _size_arg(memory_limit, "--memory-limit") if memory_limit else 0
    with obj.client() as c:
        r = follow(c, f"resuming {job}", lambda op: c.resume_job(job, memory_limit=limit, op_id=op), obj.json)
    lim = int(r.job.memory_limit_bytes)
    obj.emit({"pid": int(r.pid), "job": r.job.id, "resumed": job, "memory_limit": lim,
              "restore_ms": int(r.restore_ms), "from_store": bool(r.from_store)},
             f"resumed {job} as {r.job.id} (pid {r.pid}) in {human_ms(r.restore_ms)}"
             + (f", memory limit {human_bytes(lim)}" if lim else ""))


def _size_arg(text: str, hint: str) -> int:
    """'256M', '1G', '1.5GiB', '1048576' -> bytes (memsnap.units' grammar, as in the config file)."""
    from memsnap.units import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=hint) from None
