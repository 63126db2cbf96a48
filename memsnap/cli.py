"""memsnapctl: the command line, for people (tables, one-line summaries, progress bars) and scripts
(-o json / --json, exit codes).

Start-up matters (Slurm hooks call it for every job): this module imports only click and the standard
library; gRPC and the generated code load when a command talks to the daemon, never for --help.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from memsnap.cli_fmt import (
    Progress,
    age,
    human_bytes,
    human_ms,
    printable,
    printable_lines,
    printable_stream,
    table,
    timestamp,
    to_json,
    to_yaml,
)

if TYPE_CHECKING:
    from memsnap.client import MemsnapClient, Target
    from memsnap.v1 import memsnap_pb2 as pb

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_SOCKET = "/run/memsnap/memsnapd.sock"  # = memsnap.client.DEFAULT_SOCKET, without importing gRPC
OUTPUTS = ("table", "wide", "json", "yaml")

# Exit status per error class (documented in --help, README and the man page).
EXIT_CODES: dict[str, int] = {
    "UNKNOWN": 1, "INTERNAL": 1, "UNIMPLEMENTED": 1,
    "USAGE": 2, "INVALID_ARGUMENT": 2, "OUT_OF_RANGE": 2,
    "NOT_FOUND": 3,
    "PERMISSION_DENIED": 4, "UNAUTHENTICATED": 4,
    "UNAVAILABLE": 5, "DEADLINE_EXCEEDED": 5,
    "DATA_LOSS": 6,
    "RESOURCE_EXHAUSTED": 7,
    "FAILED_PRECONDITION": 8,
    "ABORTED": 9, "ALREADY_EXISTS": 9,
    "CANCELLED": 130,
}
EXIT_HELP = """\b
Exit status:
  0  success
  1  internal error
  2  usage error, invalid argument
  3  not found (job, checkpoint, process)
  4  permission denied, not authenticated
  5  daemon or storage unavailable, deadline exceeded
  6  data loss (an image failed its integrity check)
  7  out of resources (memory tier full, a quota reached)
  8  operation failed (CRIU refused, wrong state: the message says why)
  9  conflict (busy, already exists)
  130 interrupted"""


class Failure(Exception):
    """A failed command: a status code name (NOT_FOUND, ...) and a one-line message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message

    @property
    def exit_code(self) -> int:
        """The documented exit status for this error class."""
        return EXIT_CODES.get(self.code, 1)


def _state_names() -> dict[int, str]:
    from memsnap.v1 import memsnap_pb2 as pb

    return {v: k.removeprefix("CHECKPOINT_STATE_").lower() for k, v in pb.CheckpointState.items()}


def state_name(state: int) -> str:
    """A CheckpointState as a lower-case word."""
    return _state_names().get(state, "unknown")


def _to_dict(msg: Any) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict

    d: dict[str, Any] = MessageToDict(msg, preserving_proto_field_name=True,
                                      always_print_fields_with_no_presence=True)
    return d


def ckpt_dict(c: pb.CheckpointInfo) -> dict[str, Any]:
    """A checkpoint as plain JSON-able data, with the state as a lower-case word."""
    d = _to_dict(c)
    d["state"] = state_name(c.state)
    for k in ("pid", "created_unix_ms", "size_bytes", "frozen_ms", "dump_ms", "drained_bytes", "stored_bytes",
              "durable_unix_ms", "logical_bytes", "new_bytes", "host_bytes", "device_bytes"):
        d[k] = int(d.get(k, 0))
    for k in ("phases", "restore_phases"):
        d[k] = [{"name": p.name, "ms": int(p.ms)} for p in getattr(c, k)]
    return d


def job_dict(j: pb.Job) -> dict[str, Any]:
    """A job as plain data."""
    d = _to_dict(j)
    d["pid"], d["started_unix_ms"] = int(d.get("pid", 0)), int(d.get("started_unix_ms", 0))
    d["argv"] = command_of(list(j.argv))
    return d


def command_of(argv: list[str]) -> list[str]:
    """A job's own command, without the init it runs under (memsnap.jobinit)."""
    from memsnap import jobinit

    return argv[4:] if jobinit.is_init(argv) else argv


class Ctx:
    """Global options shared by the subcommands."""

    def __init__(self, socket: str = DEFAULT_SOCKET, address: str = "", token_file: str = "", tls_ca: str = "",
                 tls_cert: str = "", tls_key: str = "", output: str = "table") -> None:
        self.socket, self.address, self.token_file = socket, address, token_file
        self.tls_ca, self.tls_cert, self.tls_key = tls_ca, tls_cert, tls_key
        self.output = output
        self._target: Target | None = None

    @property
    def json(self) -> bool:
        """Machine-readable output (json or yaml)."""
        return self.output in ("json", "yaml")

    @property
    def target(self) -> Target:
        """Where the daemon is (reads --token-file on first use)."""
        if self._target is None:
            from memsnap.client import Target

            token = ""
            if self.token_file:
                try:
                    with open(self.token_file) as f:
                        token = f.read().strip()
                except OSError as exc:
                    raise click.UsageError(f"cannot read --token-file {self.token_file}: {exc.strerror}") from exc
            self._target = Target(socket=self.socket, address=self.address, token=token, tls_ca=self.tls_ca,
                                  tls_cert=self.tls_cert, tls_key=self.tls_key)
        return self._target

    def client(self) -> MemsnapClient:
        """A client for the selected daemon."""
        from memsnap.client import MemsnapClient

        return MemsnapClient(self.target)

    def emit(self, data: Any, human: str | list[str] | None = None, wide: str | list[str] | None = None) -> None:
        """JSON/YAML for scripts (exact), text for people (wide: the table with more columns): a list is one
        line an item; whatever users named in it is escaped (cli_fmt.printable), so a row stays one line."""
        if self.output == "yaml":
            click.echo(to_yaml(data))
        elif self.output == "json" or human is None:
            click.echo(to_json(data))
        else:
            text = wide if self.output == "wide" and wide is not None else human
            click.echo(printable_lines(text) if isinstance(text, str) else "\n".join(map(printable, text)))

    def progress(self, label: str) -> Progress | None:
        """A progress display on stderr: a bar on a terminal; plain lines for people otherwise; nothing
        for scripts reading JSON from a pipe."""
        tty = sys.stderr.isatty()
        if self.json and not tty:
            return None
        return Progress(label, sys.stderr, tty)


def handle_errors(fn: F) -> F:
    """Turns a ClientError into a Failure (main() prints it and picks the exit status)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            failure = _as_failure(exc)
            if failure is None:
                raise
            raise failure from None

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper  # type: ignore[return-value]


def _as_failure(exc: BaseException) -> Failure | None:
    if isinstance(exc, Failure):
        return exc
    client = sys.modules.get("memsnap.client")
    if client is not None and isinstance(exc, client.ClientError):
        return Failure(exc.code.name, exc.message)
    return None


# Commands that live in other modules, loaded only when used: name -> (module, one-line help).
LAZY_COMMANDS = {
    "migrate": ("memsnap.cli_migrate", "Move a PID or job to another node; on failure it runs on here."),
    "slurm": ("memsnap.slurm.cli", "Slurm integration: checkpoint on preemption, restore on requeue."),
}


class Group(click.Group):
    """Loads the migrate and slurm commands on first use, so --help never imports gRPC."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        """Every command, lazy ones included, in alphabetical order."""
        return sorted({*super().list_commands(ctx), *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        """A command, importing its module first when it is a lazy one."""
        if cmd_name in LAZY_COMMANDS and cmd_name not in self.commands:
            module = __import__(LAZY_COMMANDS[cmd_name][0], fromlist=["register"])
            module.register(self)
            if cmd_name == "slurm":
                from memsnap.cli_slurm_hooks import install_hooks_cmd

                group = self.commands.get("slurm")
                if isinstance(group, click.Group):
                    group.add_command(install_hooks_cmd)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list, with fixed help lines for the lazy commands (nothing is imported)."""
        rows = []
        for name in self.list_commands(ctx):
            if name in LAZY_COMMANDS and name not in self.commands:
                rows.append((name, LAZY_COMMANDS[name][1]))
                continue
            cmd = self.commands.get(name)
            if cmd is not None and not cmd.hidden:
                rows.append((name, cmd.get_short_help_str(limit=formatter.width - 6 - max(len(n) for n in
                                                                                        self.list_commands(ctx)))))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def _version_text() -> str:
    from memsnap.version import version_text

    return version_text()


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(_version_text())
        ctx.exit()


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_HELP)
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="print the memsnap, CRIU and kernel versions and exit")
@click.option("--socket", envvar="MEMSNAP_SOCKET", default=DEFAULT_SOCKET, show_default=True,
              help="memsnapd Unix socket (env MEMSNAP_SOCKET)")
@click.option("--address", envvar="MEMSNAP_ADDRESS", default="", help="HOST:PORT of a remote memsnapd")
@click.option("--token-file", envvar="MEMSNAP_TOKEN_FILE", default="", help="bearer token for --address")
@click.option("--tls-ca", default="", help="CA bundle to verify a remote daemon (enables TLS)")
@click.option("--tls-cert", default="", help="client certificate for mutual TLS")
@click.option("--tls-key", default="", help="client key for mutual TLS")
@click.option("-o", "--output", type=click.Choice(OUTPUTS), default=None, envvar="MEMSNAP_OUTPUT",
              help="output format; accepted anywhere on the line  [default: table]")
@click.option("--json", "as_json", is_flag=True, help="same as -o json; accepted anywhere on the line")
@click.pass_context
def cli(ctx: click.Context, socket: str, address: str, token_file: str, tls_ca: str, tls_cert: str,
        tls_key: str, output: str | None, as_json: bool) -> None:
    """memsnapctl: checkpoint and restore whole processes through memsnapd.

    \b
    Quick start:
      memsnapctl run --name train -- python train.py   # a managed job
      memsnapctl checkpoint train                      # into the memory tier; it runs on
      memsnapctl stop train                            # SIGTERM, then SIGKILL after 10 s
      memsnapctl restore train                         # its newest checkpoint
      memsnapctl list                                  # checkpoints; 'jobs' lists jobs

    JOB arguments take a job id, a job name or the job's pid. Shell completion:
    eval "$(_MEMSNAPCTL_COMPLETE=bash_source memsnapctl)" (zsh_source, fish_source likewise).
    """
    ctx.obj = Ctx(socket=socket, address=address, token_file=token_file, tls_ca=tls_ca, tls_cert=tls_cert,
                  tls_key=tls_key, output="json" if as_json else (output or "table"))


@cli.command("status")
@click.pass_obj
@handle_errors
def status_cmd(obj: Ctx) -> None:
    """Versions, tier use and counts."""
    with obj.client() as c:
        s = c.status()
    d = _to_dict(s)
    for k in ("tier_used_bytes", "tier_free_bytes", "tier_capacity_bytes", "drain_queue_bytes"):
        d[k] = int(d.get(k, 0))
    d["usage"] = [{k: int(v) for k, v in u.items()} for u in d.get("usage", [])]
    by_state = ", ".join(f"{k} {v}" for k, v in sorted(s.checkpoints_by_state.items())) or "none"
    human = [
        f"memsnapd {s.version} on {s.hostname} (kernel {s.kernel}), CRIU {s.criu_version}",
        f"tier     {s.tier_dir}: {human_bytes(s.tier_used_bytes)} used, {human_bytes(s.tier_free_bytes)} free "
        f"of {human_bytes(s.tier_capacity_bytes)}" + (f"; {s.tier_fs}" if s.tier_fs else ""),
        f"store    {s.store}",
        *_bad_objects_lines(s),
        *([f"guard    {s.guard}"] if s.guard else []),
        f"jobs     {s.jobs_running} running",
        f"ckpts    {s.checkpoints} ({by_state}); drain queue {s.drain_queue_depth} "
        f"({human_bytes(s.drain_queue_bytes)})",
        *([f"drains   paused: yes, since {timestamp(s.drains_paused_since_unix_ms)} ({s.drains_paused_reason})"]
          if s.drains_paused else []),
        *([f"moves    {len(s.moves_in_doubt)} in doubt (stopped here until the target answers): "
           + ", ".join(s.moves_in_doubt)] if s.moves_in_doubt else []),
        *[f"usage    uid {u.uid}: {usage_line(u)}" for u in s.usage],
    ]
    obj.emit(d, human)


def usage_line(u: pb.QuotaUsage) -> str:
    """'tier 300.0 MiB of 1.0 GiB, store 2.0 GiB, jobs 1 of 2, checkpoints 3 of 3' (of: its [quota] limit)."""
    def part(what: str, field: str, fmt: Callable[[int], str]) -> str:
        lim = f" of {fmt(getattr(u, field + '_limit'))}" if u.HasField(field + "_limit") else ""
        return f"{what} {fmt(getattr(u, field))}{lim}"

    return ", ".join([part("tier", "tier_bytes", human_bytes), part("store", "store_bytes", human_bytes),
                      part("jobs", "jobs", str), part("checkpoints", "checkpoints", str)])


def _bad_objects_lines(s: pb.StatusResponse) -> list[str]:
    """What drains and gc skip in the store (objects memsnap did not write): the count, the newest three."""
    if not s.store_bad_object_count:
        return []
    return [f"         {s.store_bad_object_count} objects in the store skipped as not memsnap's (-o json lists "
            "20):", *(f"           {line}" for line in s.store_bad_objects[:3])]


@cli.command("run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
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
    keep: dict[str, Any] = {"keep_last": keep_last, "keep_within_s": _duration_arg(keep_within, "--keep-within")}
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


@cli.command("jobs")
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


def _ckpt_summary(d: dict[str, Any]) -> str:
    where = "tier" if d.get("in_tier") else ""
    where += ("+store" if where else "store") if d.get("in_store") else ""
    return (f"{d['id']}: {d['state']}, {human_bytes(d['size_bytes'])}, job frozen {human_ms(d['frozen_ms'])}"
            f" (dump {human_ms(d['dump_ms'])})" + (f", in {where}" if where else ""))


# checkpoint and migrate: what a dump does with a connection still in a listener's accept queue.
SKIP_IN_FLIGHT = click.option(
    "--skip-in-flight/--fail-on-in-flight", default=True, show_default=True,
    help="leave out connections still in a listener's accept queue (a busy server's: their clients see a reset, "
         "as after a restart), or fail on one")


@cli.command("checkpoint")
@click.argument("target")
@click.option("--stop", is_flag=True, help="end the job once the image is safely staged")
@click.option("--wait", "wait_for", type=click.Choice(["staged", "durable"]), default="staged",
              show_default=True, help="return once the checkpoint is staged or durable")
@click.option("--tcp-established", is_flag=True,
              help="also dump established TCP connections (without it a restored copy has them closed: its clients "
                   "reconnect, as after a restart)")
@SKIP_IN_FLIGHT
@click.option("--name", default="", help="label for the checkpoint")
@click.option("--keep-last", type=click.IntRange(0, 1_000_000), default=None, metavar="N",
              help="from now on gc keeps the newest N checkpoints of this job (or process)")
@click.option("--keep-within", default=None, metavar="DURATION",
              help="from now on gc keeps its checkpoints younger than this, e.g. 30m, 2h, 7d")
@click.pass_obj
@handle_errors
def checkpoint_cmd(obj: Ctx, target: str, stop: bool, wait_for: str, tcp_established: bool, skip_in_flight: bool,
                   name: str, keep_last: int | None, keep_within: str | None) -> None:
    """Checkpoint a PID or JOB into the memory tier (it keeps running unless --stop)."""
    durable = wait_for == "durable"
    bar = obj.progress("") if durable else None
    keep: dict[str, Any] = {"keep_last": keep_last, "keep_within_s": _duration_arg(keep_within, "--keep-within"),
                            "fail_on_in_flight": not skip_in_flight}
    with obj.client() as c:
        if bar is None:
            ck = c.checkpoint(target, stop=stop, wait_durable=durable, tcp_established=tcp_established, name=name,
                              **keep)
        else:
            if c.status().store in ("", "none"):
                raise Failure("INVALID_ARGUMENT", "this daemon has no store configured, so nothing becomes "
                                                  "durable; use --wait staged")
            ck = c.checkpoint(target, stop=stop, tcp_established=tcp_established, name=name, **keep)
            bar.label = f"draining {ck.id}"
            _follow_drain(c, ck.id, bar)
            ck = c.show(ck.id)
    d = ckpt_dict(ck)
    if d["state"] == "failed":
        raise Failure("FAILED_PRECONDITION", f"checkpoint {ck.id} failed: {ck.last_error}")
    say_in_job(obj, d, target, ck.job, "" if name else ck.name, ck.pid, "checkpointed")
    obj.emit(d, _ckpt_summary(d))


def say_in_job(obj: Ctx, data: dict[str, Any], target: str, job_id: str, job_name: str, job_pid: int,
               done: str) -> None:
    """A pid inside a job named the whole job (memsnap.resolve): says so on stderr, and as "note" in the JSON."""
    from memsnap.resolve import in_job_note

    note = in_job_note(target, job_id, job_name, job_pid, done)
    if note:
        data["note"] = note
        if not obj.json:
            click.echo(printable(note), err=True)


def _follow_drain(c: MemsnapClient, ckpt_id: str, bar: Progress) -> None:
    for k in c.watch(ckpt_id):
        state = state_name(k.state)
        total = max(int(k.size_bytes), 1)
        done = total if state == "durable" else int(k.drained_bytes)
        bar.update(done, total, state, _drain_note(k, state))
    bar.done()


def _drain_note(k: pb.CheckpointInfo, state: str) -> str:
    """What to say about a checkpoint's last error: only a drain in progress is ever retried."""
    if not k.last_error or state == "durable":
        return ""
    if state == "failed":
        return f"failed: {k.last_error}"
    return f"storage error (attempt {k.drain_attempts}, will retry): {k.last_error}"


@cli.command("restore")
@click.argument("checkpoint_id", metavar="CHECKPOINT|JOB")
@click.option("--lazy", is_flag=True, help="resume at once; memory is paged in on demand")
@click.option("--gpu-map", default="", help="OLD_UUID=NEW_UUID,... to remap GPUs")
@click.option("--tcp-established", is_flag=True, help="restore established TCP connections")
@click.pass_obj
@handle_errors
def restore_cmd(obj: Ctx, checkpoint_id: str, lazy: bool, gpu_map: str, tcp_established: bool) -> None:
    """Verify a checkpoint (or a job's newest one) and restore it detached.

    A fetch from the store shows its progress on stderr (rate and ETA; -o json: one object per update)."""
    mapping: dict[str, str] = {}
    for pair in filter(None, gpu_map.split(",")):
        old, sep, new = pair.partition("=")
        if not sep or not old or not new:
            raise click.BadParameter(f"{pair!r} is not OLD_UUID=NEW_UUID", param_hint="--gpu-map")
        mapping[old.strip()] = new.strip()
    from memsnap.cli_follow import follow

    with obj.client() as c:
        r = follow(c, f"restoring {checkpoint_id}",
                   lambda op: c.restore(checkpoint_id, lazy=lazy, gpu_map=mapping, tcp_established=tcp_established,
                                        op_id=op), obj.json)
    chosen = r.job.restored_from or checkpoint_id
    fetched = f", fetched from the store in {human_ms(r.fetch_ms)}" if r.from_store else ""
    if lazy:  # (from the store: only the small files came first, docs/lazy-store.md)
        fetched += "; its memory pages in lazily"
    obj.emit({"pid": int(r.pid), "job": r.job.id, "checkpoint": chosen, "requested": checkpoint_id,
              "restore_ms": int(r.restore_ms), "verify_ms": int(r.verify_ms), "fetch_ms": int(r.fetch_ms),
              "from_store": r.from_store},
             f"restored {chosen} as {r.job.id} (pid {r.pid}) in {human_ms(r.restore_ms)} "
             f"(verify {human_ms(r.verify_ms)}{fetched})")


def _location(k: pb.CheckpointInfo) -> str:
    return "+".join(w for w, on in (("tier", k.in_tier), ("store", k.in_store)) if on) or "-"


@cli.command("list")
@click.option("--job", default="", help="only this job's checkpoints")
@click.pass_obj
@handle_errors
def list_cmd(obj: Ctx, job: str) -> None:
    """Checkpoints, oldest first."""
    with obj.client() as c:
        cks = c.list(job)
    rows, wide = [], []
    for k in cks:
        row = [k.id, k.name or "-", state_name(k.state), k.job or str(k.pid), human_bytes(k.logical_bytes),
               *_stored_cols(k), _location(k), age(k.created_unix_ms)]
        rows.append(row)
        wide.append([*row, human_ms(k.frozen_ms), (k.last_error or "-")[:60]])
    head = ["ID", "NAME", "STATE", "JOB/PID", "SIZE", "STORED", "NEW", "WHERE", "AGE"]
    obj.emit([ckpt_dict(k) for k in cks], table(rows, head), table(wide, [*head, "FROZEN", "ERROR"]))


def _stored_cols(k: pb.CheckpointInfo) -> list[str]:
    """STORED and NEW: what it wrote to the store, and how much of its image was new there ("-" until
    durable)."""
    if not k.in_store:
        return ["-", "-"]
    return [human_bytes(k.stored_bytes), human_bytes(k.new_bytes)]


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
        f"id          {k.id}", f"name        {k.name or '-'}", f"state       {d['state']}",
        f"job         {k.job or '-'} (pid {k.pid}, uid {k.owner_uid})",
        f"command     {' '.join(command_of(list(k.argv)))}", f"host        {k.hostname}  criu {k.criu_version}",
        f"created     {timestamp(k.created_unix_ms)} ({age(k.created_unix_ms)} ago)",
        f"durable     {timestamp(k.durable_unix_ms)}",
        f"size        {human_bytes(k.logical_bytes)}{_split(k)}  frozen {human_ms(k.frozen_ms)}  "
        f"dump {human_ms(k.dump_ms)}",
        f"stored      {_stored_line(k)}",
        f"in_tier     {str(k.in_tier).lower()}", f"in_store    {str(k.in_store).lower()}",
        f"drained     {human_bytes(k.drained_bytes)} of {human_bytes(k.size_bytes)} "
        f"({human_bytes(k.stored_bytes)} stored, {k.drain_attempts} attempts)",
        f"last_error  {k.last_error or '-'}",
    ]
    for g in k.gpus:
        lines.append(f"gpu         {g.model} {g.uuid} driver {g.driver_version} "
                     f"{human_bytes(g.device_bytes)} (pid {g.pid})")
    for label, phases in (("phases", k.phases), ("restored in", k.restore_phases)):
        if phases:
            lines.append(f"{label:<11} " + ", ".join(f"{p.name} {human_ms(p.ms)}" for p in phases))
    obj.emit(d, lines)


def _split(k: pb.CheckpointInfo) -> str:
    """' (host X + device Y)' for an image that holds device memory, else ''."""
    return f" (host {human_bytes(k.host_bytes)} + device {human_bytes(k.device_bytes)})" if k.device_bytes else ""


def _stored_line(k: pb.CheckpointInfo) -> str:
    if not k.in_store:
        return "- (not in the store yet)"
    return (f"{human_bytes(k.stored_bytes)} written to the store; {human_bytes(k.new_bytes)} of its "
            f"{human_bytes(k.logical_bytes)} were new there (the rest deduplicated)")


@cli.command("delete")
@click.argument("checkpoint_ids", nargs=-1, required=True, metavar="CHECKPOINT...")
@click.pass_obj
@handle_errors
def delete_cmd(obj: Ctx, checkpoint_ids: tuple[str, ...]) -> None:
    """Delete checkpoints from the tier, the store and the catalog."""
    with obj.client() as c:
        for ckpt in checkpoint_ids:
            note = c.delete(ckpt).note  # (another node's stored copy stays: only this node's row went)
            obj.emit({"deleted": ckpt, **({"note": note} if note else {})}, note or f"deleted {ckpt}")


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
    """Follow a checkpoint's drain until it is durable: a bar with rate and ETA on a terminal, a line per
    quarter otherwise; -o json streams one object per update."""
    last: pb.CheckpointInfo | None = None
    bar = Progress(checkpoint_id, sys.stdout, sys.stdout.isatty())
    with obj.client() as c:
        for k in c.watch(checkpoint_id):
            last = k
            state = state_name(k.state)
            if obj.json:
                click.echo(to_json(ckpt_dict(k)) if obj.output == "json" else to_yaml([ckpt_dict(k)]))
                continue
            total = max(int(k.size_bytes), 1)
            bar.update(total if state == "durable" else int(k.drained_bytes), total, state, _drain_note(k, state))
    if not obj.json:
        bar.done()
    if last is not None and state_name(last.state) == "failed":
        raise Failure("FAILED_PRECONDITION", f"checkpoint {checkpoint_id} failed: {last.last_error}")


@cli.command("stop")
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


@cli.command("kill")
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


@cli.command("rm")
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


@cli.command("prune")
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


@cli.command("gc")
@click.option("--dry-run", is_flag=True, help="only report what would be deleted and swept")
@click.pass_obj
@handle_errors
def gc_cmd(obj: Ctx, dry_run: bool) -> None:
    """Delete the checkpoints the retention policy lets go (never a job's newest durable one, nor one in
    use) and, as root, sweep store chunks no checkpoint references. docs/retention.md says how."""
    with obj.client() as c:
        r = c.gc(dry_run=dry_run)
    verb = "would delete" if dry_run else "deleted"
    theirs = {g.id: g.reason for g in r.forgotten}  # (only this node's row: the stored copy is another node's)
    lines = [f"{verb} {k.id} ({k.name or k.job or k.pid}, {age(k.created_unix_ms)} old, "
             + (f"here only: its stored copy stays, {theirs[k.id]})" if k.id in theirs else
                f"{human_bytes(k.stored_bytes)} stored)") for k in r.deleted]
    kept = [f"kept {g.id}: {g.reason}" for g in r.kept]
    whole = f" ({human_bytes(r.checkpoint_bytes)} of whole-file copies)" if r.checkpoint_bytes else ""
    summary = [f"{verb} {len(r.deleted)} checkpoints{whole}, kept {len(r.kept)}"]
    if r.swept:
        summary.append(f"{'would sweep' if dry_run else 'swept'} {r.chunks_swept} chunks "
                       f"({human_bytes(r.chunk_bytes_freed)}); {r.chunks_in_grace} unreferenced chunks in their "
                       "grace period")
    else:
        summary.append(f"no chunk sweep: {r.sweep_note}")
    obj.emit({"dry_run": r.dry_run, "deleted": [k.id for k in r.deleted],
              "kept": [{"id": g.id, "reason": g.reason} for g in r.kept],
              "checkpoint_bytes": int(r.checkpoint_bytes), "swept": r.swept, "sweep_note": r.sweep_note,
              "chunks_swept": int(r.chunks_swept), "chunk_bytes_freed": int(r.chunk_bytes_freed),
              "chunks_in_grace": int(r.chunks_in_grace), "bytes_freed": int(r.checkpoint_bytes + r.chunk_bytes_freed),
              "duration_ms": int(r.duration_ms), "forgotten": [{"id": g.id, "reason": g.reason} for g in r.forgotten]},
             [*lines, *summary], [*lines, *kept, *summary])


def _duration_arg(text: str | None, hint: str) -> float | None:
    """'30m', '2h', '7d' -> seconds (None stays None)."""
    if text is None:
        return None
    from memsnap.retention import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=hint) from None


@cli.command("logs")
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


# -- entry point -----------------------------------------------------------------------------------

def hoist_output_options(args: list[str]) -> list[str]:
    """Moves --json and -o/--output FORMAT to the front, wherever they are on the line, so that
    `memsnapctl status --json` works like kubectl. Nothing after `--` moves, nor anything from the command
    of `run` / `slurm run` on (those words belong to the job)."""
    front: list[str] = []
    rest: list[str] = []
    words: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--" or (not a.startswith("-") and words in (["run"], ["slurm", "run"])):
            rest += args[i:]
            break
        if a == "--json":
            front.append(a)
        elif a in ("-o", "--output") and i + 1 < len(args):
            front += ["--output", args[i + 1]]
            i += 1
        elif a.startswith("--output="):
            front += ["--output", a.split("=", 1)[1]]
        elif a.startswith("-o") and len(a) > 2 and not a.startswith("--"):
            front += ["--output", a[2:]]
        elif (a in _VALUED_GLOBALS and not words or a in _VALUED_RUN and words in (["run"], ["slurm", "run"])) \
                and i + 1 < len(args):
            rest += [a, args[i + 1]]
            i += 1
        else:
            if not a.startswith("-"):
                words.append(a)
            rest.append(a)
        i += 1
    return front + rest


_VALUED_GLOBALS = ("--socket", "--address", "--token-file", "--tls-ca", "--tls-cert", "--tls-key")
# options of run / slurm run that take a value
_VALUED_RUN = ("--name", "--interval", "--grace", "--socket", "--keep-last", "--keep-within")


def _wants_json(args: list[str]) -> str:
    out = "table"
    for i, a in enumerate(args):
        if a == "--":
            break
        if a == "--json":
            out = "json"
        elif a == "--output" and i + 1 < len(args):
            out = args[i + 1]
    return out if out in OUTPUTS else "table"


def fail(code: str, message: str, output: str = "table") -> NoReturn:
    """Prints an error (one line; a JSON object with -o json) on stderr and exits with its status."""
    f = Failure(code, message)
    if output in ("json", "yaml"):
        click.echo(to_json({"error": {"code": code, "message": message, "exit_code": f.exit_code}}), err=True)
    else:
        click.echo(f"memsnapctl: {code}: {printable(message)}", err=True)
    sys.exit(f.exit_code)


@cli.command("resume")
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


def main(argv: list[str] | None = None) -> None:
    """Entry point of the memsnapctl console script."""
    args = hoist_output_options(list(sys.argv[1:] if argv is None else argv))
    output = _wants_json(args)
    try:
        rv = cli.main(args=args, prog_name="memsnapctl", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        if output in ("json", "yaml"):
            fail("USAGE", exc.format_message(), output)
        exc.show(file=printable_stream(sys.stderr))  # (click quotes what was typed: a name, a command)
        sys.exit(2 if isinstance(exc, click.UsageError) else exc.exit_code)
    except (click.Abort, KeyboardInterrupt):
        if output not in ("json", "yaml"):
            click.echo("memsnapctl: interrupted", err=True)
        sys.exit(130)
    except Exception as exc:
        failure = _as_failure(exc)
        if failure is None:
            raise
        fail(failure.code, failure.message, output)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    # `python -m memsnap.cli` runs this file as __main__, a second copy of the module: the command groups
    # registered from other modules (migrate, slurm) raise memsnap.cli.Failure, which this copy's
    # handlers would not recognise. Run the real module's main instead.
    from memsnap.cli import main as _main

    _main()
