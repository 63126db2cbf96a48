"""memsnapctl: the command line, for people (tables, progress bars) and scripts (--json)."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import click
from google.protobuf.json_format import MessageToDict

from memsnap.client import DEFAULT_SOCKET, ClientError, MemsnapClient, Target
from memsnap.v1 import memsnap_pb2 as pb

F = TypeVar("F", bound=Callable[..., Any])

STATE_NAMES = {v: k.removeprefix("CHECKPOINT_STATE_").lower() for k, v in pb.CheckpointState.items()}


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def ckpt_dict(c: pb.CheckpointInfo) -> dict[str, Any]:
    """A checkpoint as plain JSON-able data, with the state as a lower-case word."""
    d: dict[str, Any] = MessageToDict(c, preserving_proto_field_name=True,
                                      always_print_fields_with_no_presence=True)
    d["state"] = STATE_NAMES.get(c.state, "unknown")
    for k in ("pid", "created_unix_ms", "size_bytes", "frozen_ms", "dump_ms", "drained_bytes", "stored_bytes",
              "durable_unix_ms"):
        d[k] = int(d.get(k, 0))
    return d


def job_dict(j: pb.Job) -> dict[str, Any]:
    """A job as plain data."""
    d: dict[str, Any] = MessageToDict(j, preserving_proto_field_name=True,
                                      always_print_fields_with_no_presence=True)
    d["pid"], d["started_unix_ms"] = int(d.get("pid", 0)), int(d.get("started_unix_ms", 0))
    return d


def table(rows: list[list[str]], header: list[str]) -> str:
    """Left-aligned columns."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*r).rstrip() for r in [header, *rows])


class Ctx:
    """Global options shared by the subcommands."""

    def __init__(self, target: Target, as_json: bool) -> None:
        self.target = target
        self.json = as_json

    def client(self) -> MemsnapClient:
        """A client for the selected daemon."""
        return MemsnapClient(self.target)

    def emit(self, data: Any, human: str | None = None) -> None:
        """JSON for scripts, text for people."""
        if self.json or human is None:
            click.echo(json.dumps(data, sort_keys=True))
        else:
            click.echo(human)


def handle_errors(fn: F) -> F:
    """One line on stderr and a non-zero exit for any failure."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ClientError as exc:
            click.echo(f"memsnapctl: {exc.code.name}: {exc.message}", err=True)
            sys.exit(2 if exc.code.name in ("INVALID_ARGUMENT", "NOT_FOUND") else 1)

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper  # type: ignore[return-value]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--socket", envvar="MEMSNAP_SOCKET", default=DEFAULT_SOCKET, show_default=True,
              help="memsnapd Unix socket (env MEMSNAP_SOCKET)")
@click.option("--address", envvar="MEMSNAP_ADDRESS", default="", help="HOST:PORT of a remote memsnapd")
@click.option("--token-file", envvar="MEMSNAP_TOKEN_FILE", default="", help="bearer token for --address")
@click.option("--tls-ca", default="", help="CA bundle to verify a remote daemon (enables TLS)")
@click.option("--tls-cert", default="", help="client certificate for mutual TLS")
@click.option("--tls-key", default="", help="client key for mutual TLS")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.pass_context
def cli(ctx: click.Context, socket: str, address: str, token_file: str, tls_ca: str, tls_cert: str,
        tls_key: str, as_json: bool) -> None:
    """memsnapctl: checkpoint and restore whole processes through memsnapd."""
    token = ""
    if token_file:
        try:
            with open(token_file) as f:
                token = f.read().strip()
        except OSError as exc:
            raise click.UsageError(f"cannot read --token-file {token_file}: {exc.strerror}") from exc
    ctx.obj = Ctx(Target(socket=socket, address=address, token=token, tls_ca=tls_ca, tls_cert=tls_cert,
                         tls_key=tls_key), as_json)


@cli.command("status")
@click.pass_obj
@handle_errors
def status_cmd(obj: Ctx) -> None:
    """Versions, tier use and counts."""
    with obj.client() as c:
        s = c.status()
    d = MessageToDict(s, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    for k in ("tier_used_bytes", "tier_free_bytes", "tier_capacity_bytes", "drain_queue_bytes"):
        d[k] = int(d.get(k, 0))
    by_state = ", ".join(f"{k} {v}" for k, v in sorted(s.checkpoints_by_state.items())) or "none"
    human = "\n".join([
        f"memsnapd {s.version} on {s.hostname} (kernel {s.kernel}), CRIU {s.criu_version}",
        f"tier     {s.tier_dir}: {human_bytes(s.tier_used_bytes)} used, {human_bytes(s.tier_free_bytes)} free "
        f"of {human_bytes(s.tier_capacity_bytes)}",
        f"store    {s.store}",
        *([f"guard    {s.guard}"] if s.guard else []),
        f"jobs     {s.jobs_running} running",
        f"ckpts    {s.checkpoints} ({by_state}); drain queue {s.drain_queue_depth} "
        f"({human_bytes(s.drain_queue_bytes)})",
        *([f"moves    {len(s.moves_in_doubt)} in doubt (stopped here until the target answers): "
           + ", ".join(s.moves_in_doubt)] if s.moves_in_doubt else []),
    ])
    obj.emit(d, human)


@cli.command("run", context_settings={"ignore_unknown_options": True})
@click.option("--name", default="", help="a name to find the job by")
@click.option("--own-proc/--host-proc", "own_proc", default=None,
              help="give the job its own /proc (a mount namespace; CUDA needs it), or the host's; "
                   "default: its own on a node with an NVIDIA GPU")
@click.option("--memory-limit", default="", help="its own memory cgroup with this limit, e.g. 256M, 4G")
@click.option("--priority", default="0", help="node pressure parks the lowest first: -1000..1000, or critical "
                                               "(never parked by node pressure)")
@click.option("--on-limit", type=click.Choice(["park", "kill"]), default="park", show_default=True,
              help="at its memory limit: checkpoint and stop it (resume later), or let it be killed")
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_obj
@handle_errors
def run_cmd(obj: Ctx, name: str, own_proc: bool | None, memory_limit: str, priority: str, on_limit: str,
            argv: tuple[str, ...]) -> None:
    """Start CMD as a managed job in its own PID namespace: memsnapctl run -- CMD ARGS..."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSNAP_SOCKET")}
    limit = _size_arg(memory_limit, "--memory-limit") if memory_limit else 0
    critical = priority.strip().lower() == "critical"
    try:
        prio = 0 if critical else int(priority)
    except ValueError:
        raise click.BadParameter(f"{priority!r} is not a number or critical", param_hint="--priority") from None
    guarded = {"memory_limit": limit, "priority": prio, "critical": critical,
               "on_limit": on_limit if (limit or prio or critical) else ""}
    with obj.client() as c:
        job = c.run(list(argv), name=name, cwd=os.getcwd(), env=env, own_proc=own_proc, **guarded)  # type: ignore[arg-type]
    obj.emit({"job": job.id, "pid": int(job.pid), "name": job.name, "log": job.log_path})


@cli.command("jobs")
@click.pass_obj
@handle_errors
def jobs_cmd(obj: Ctx) -> None:
    """Managed jobs (launched or restored by memsnap)."""
    with obj.client() as c:
        js = c.jobs()
    rows = [[j.id, j.name, str(j.pid), j.guard_state if j.guard_state in ("parked", "resumed", "killed")
             else "running" if j.running else "ended", j.restored_from or "-",
             " ".join(j.argv)[:50]] for j in js]
    obj.emit([job_dict(j) for j in js], table(rows, ["JOB", "NAME", "PID", "STATE", "FROM", "COMMAND"]))


@cli.command("checkpoint")
@click.argument("target")
@click.option("--stop", is_flag=True, help="end the job once the image is safely staged")
@click.option("--wait", "wait_for", type=click.Choice(["staged", "durable"]), default="staged",
              show_default=True, help="return once the checkpoint is staged or durable")
@click.option("--tcp-established", is_flag=True, help="also dump established TCP connections")
@click.option("--name", default="", help="label for the checkpoint")
@click.pass_obj
@handle_errors
def checkpoint_cmd(obj: Ctx, target: str, stop: bool, wait_for: str, tcp_established: bool, name: str) -> None:
    """Checkpoint a PID or job into the memory tier (it keeps running unless --stop)."""
    with obj.client() as c:
        ck = c.checkpoint(target, stop=stop, wait_durable=wait_for == "durable",
                          tcp_established=tcp_established, name=name)
    obj.emit(ckpt_dict(ck))


@cli.command("restore")
@click.argument("checkpoint_id")
@click.option("--lazy", is_flag=True, help="resume at once; memory is paged in on demand")
@click.option("--gpu-map", default="", help="OLD_UUID=NEW_UUID,... to remap GPUs")
@click.option("--tcp-established", is_flag=True, help="restore established TCP connections")
@click.pass_obj
@handle_errors
def restore_cmd(obj: Ctx, checkpoint_id: str, lazy: bool, gpu_map: str, tcp_established: bool) -> None:
    """Verify a checkpoint (or a job's latest one) and restore it detached."""
    mapping: dict[str, str] = {}
    for pair in filter(None, gpu_map.split(",")):
        old, sep, new = pair.partition("=")
        if not sep or not old or not new:
            raise click.BadParameter(f"{pair!r} is not OLD_UUID=NEW_UUID", param_hint="--gpu-map")
        mapping[old.strip()] = new.strip()
    with obj.client() as c:
        r = c.restore(checkpoint_id, lazy=lazy, gpu_map=mapping, tcp_established=tcp_established)
    obj.emit({"pid": int(r.pid), "job": r.job.id, "checkpoint": checkpoint_id, "restore_ms": int(r.restore_ms),
              "verify_ms": int(r.verify_ms), "fetch_ms": int(r.fetch_ms), "from_store": r.from_store})


@cli.command("list")
@click.option("--job", default="", help="only this job's checkpoints")
@click.pass_obj
@handle_errors
def list_cmd(obj: Ctx, job: str) -> None:
    """Checkpoints, oldest first."""
    with obj.client() as c:
        cks = c.list(job)
    rows = [[k.id, STATE_NAMES.get(k.state, "?"), k.job or str(k.pid), human_bytes(k.size_bytes),
             "yes" if k.in_tier else "no", "yes" if k.in_store else "no",
             time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(k.created_unix_ms / 1000))] for k in cks]
    obj.emit([ckpt_dict(k) for k in cks],
             table(rows, ["ID", "STATE", "JOB/PID", "SIZE", "TIER", "STORE", "CREATED"]))


@cli.command("show")
@click.argument("checkpoint_id")
@click.pass_obj
@handle_errors
def show_cmd(obj: Ctx, checkpoint_id: str) -> None:
    """One checkpoint in detail."""
    with obj.client() as c:
        k = c.show(checkpoint_id)
    d = ckpt_dict(k)
    lines = [
        f"id          {k.id}", f"state       {d['state']}", f"job         {k.job or '-'} (pid {k.pid})",
        f"command     {' '.join(k.argv)}", f"host        {k.hostname}  criu {k.criu_version}",
        f"size        {human_bytes(k.size_bytes)}  frozen {k.frozen_ms} ms  dump {k.dump_ms} ms",
        f"in_tier     {str(k.in_tier).lower()}", f"in_store    {str(k.in_store).lower()}",
        f"drained     {human_bytes(k.drained_bytes)} of {human_bytes(k.size_bytes)} "
        f"({human_bytes(k.stored_bytes)} stored)",
        f"last_error  {k.last_error or '-'}",
    ]
    for g in k.gpus:
        lines.append(f"gpu         {g.model} {g.uuid} driver {g.driver_version} "
                     f"{human_bytes(g.device_bytes)} (pid {g.pid})")
    obj.emit(d, "\n".join(lines))


@cli.command("delete")
@click.argument("checkpoint_id")
@click.pass_obj
@handle_errors
def delete_cmd(obj: Ctx, checkpoint_id: str) -> None:
    """Delete a checkpoint from the tier, the store and the catalog."""
    with obj.client() as c:
        c.delete(checkpoint_id)
    obj.emit({"deleted": checkpoint_id}, f"deleted {checkpoint_id}")


@cli.command("evict")
@click.argument("checkpoint_id")
@click.pass_obj
@handle_errors
def evict_cmd(obj: Ctx, checkpoint_id: str) -> None:
    """Drop the tier copy of a durable checkpoint (the stored copy stays)."""
    with obj.client() as c:
        k = c.evict(checkpoint_id)
    obj.emit(ckpt_dict(k), f"evicted {checkpoint_id} from the tier; it stays durable in the store")


@cli.command("watch")
@click.argument("checkpoint_id")
@click.pass_obj
@handle_errors
def watch_cmd(obj: Ctx, checkpoint_id: str) -> None:
    """Follow a checkpoint's drain with a progress bar until it is durable."""
    last: pb.CheckpointInfo | None = None
    with obj.client() as c:
        for k in c.watch(checkpoint_id):
            last = k
            state = STATE_NAMES.get(k.state, "?")
            if obj.json:
                click.echo(json.dumps(ckpt_dict(k), sort_keys=True))
                continue
            total = max(k.size_bytes, 1)
            frac = min(1.0, k.drained_bytes / total) if state != "durable" else 1.0
            bar = "#" * int(frac * 30)
            err = f"  retrying: {k.last_error}" if k.last_error and state != "durable" else ""
            click.echo(f"\r{k.id} [{bar:<30}] {frac * 100:5.1f}% {human_bytes(k.drained_bytes)}/"
                       f"{human_bytes(k.size_bytes)} {state}{err}\033[K", nl=False)
    if not obj.json:
        click.echo()
    if last is not None and STATE_NAMES.get(last.state) == "failed":
        click.echo(f"memsnapctl: checkpoint {checkpoint_id} failed: {last.last_error}", err=True)
        sys.exit(1)


@cli.command("resume")
@click.argument("job")
@click.option("--memory-limit", default="", help="a new memory limit for it, e.g. 1G (default: its old one)")
@click.pass_obj
@handle_errors
def resume_cmd(obj: Ctx, job: str, memory_limit: str) -> None:
    """Resume a job the memory guard parked (at its limit, or under node pressure)."""
    limit = _size_arg(memory_limit, "--memory-limit") if memory_limit else 0
    with obj.client() as c:
        r = c.resume_job(job, memory_limit=limit)
    obj.emit({"pid": int(r.pid), "job": r.job.id, "resumed": job, "memory_limit": int(r.job.memory_limit_bytes),
              "restore_ms": int(r.restore_ms)})


def _size_arg(text: str, hint: str) -> int:
    """'256M', '1G', '1.5GiB', '1048576' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise click.BadParameter(f"{text!r} is not a size such as 256M or 4G", param_hint=hint)
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))


def main() -> None:
    """Entry point of the memsnapctl console script."""
    _register_extensions()
    cli(prog_name="memsnapctl")


def _register_extensions() -> None:
    """Adds the migrate and slurm command groups when their modules are present."""
    for mod in ("memsnap.cli_migrate", "memsnap.slurm.cli"):
        try:
            m = __import__(mod, fromlist=["register"])
        except ImportError:
            continue
        m.register(cli)


if __name__ == "__main__":
    main()
