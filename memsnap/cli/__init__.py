"""memsnapctl: the command line, for people (tables, one-line summaries, progress bars) and scripts
(-o json / --json, exit codes).

This package is the command tree, its global options, `status` and the entry point (main); the commands live
by concern: memsnap.cli.checkpoints (checkpoint, restore, list, show, watch, evict, delete, gc),
memsnap.cli.jobs (run, jobs, logs, stop, kill, rm, prune, resume), memsnap.cli.migrate, and
memsnap.slurm.cli (loaded on first use); memsnap.cli.core holds what they share, memsnap.cli_fmt the output.

Start-up matters (Slurm hooks call it for every job): these modules import only click and the standard
library; gRPC and the generated code load when a command talks to the daemon, never for --help.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import click

from memsnap.cli import checkpoints, jobs, migrate
from memsnap.cli.core import (
    DEFAULT_SOCKET,
    EXIT_CODES,
    EXIT_HELP,
    OUTPUTS,
    Ctx,
    Failure,
    as_failure,
    fail,
    handle_errors,
    to_dict,
)
from memsnap.cli.jobs import guard_args
from memsnap.cli_fmt import human_bytes, printable_stream, timestamp

if TYPE_CHECKING:
    from memsnap.v1 import memsnap_pb2 as pb

__all__ = ["EXIT_CODES", "EXIT_HELP", "Ctx", "Failure", "cli", "fail", "guard_args", "hoist_output_options",
           "main"]

# Commands that live in other modules, loaded only when used: name -> (module, one-line help).
LAZY_COMMANDS = {
    "slurm": ("memsnap.slurm.cli", "Slurm integration: checkpoint on preemption, restore on requeue."),
}


class Group(click.Group):
    """Loads the slurm commands on first use, so --help never imports gRPC."""

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


# The commands of the other modules (status is below; slurm loads on first use: LAZY_COMMANDS).
for _cmd in (checkpoints.checkpoint_cmd, checkpoints.restore_cmd, checkpoints.list_cmd, checkpoints.show_cmd,
             checkpoints.delete_cmd, checkpoints.evict_cmd, checkpoints.watch_cmd, checkpoints.gc_cmd,
             jobs.run_cmd, jobs.jobs_cmd, jobs.stop_cmd, jobs.kill_cmd, jobs.rm_cmd, jobs.prune_cmd, jobs.logs_cmd,
             jobs.resume_cmd, migrate.migrate_cmd):
    cli.add_command(_cmd)


@cli.command("status")
@click.pass_obj
@handle_errors
def status_cmd(obj: Ctx) -> None:
    """Versions, tier use and counts."""
    with obj.client() as c:
        s = c.status()
    d = to_dict(s)
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
        failure = as_failure(exc)
        if failure is None:
            raise
        fail(failure.code, failure.message, output)
    sys.exit(rv if isinstance(rv, int) else 0)
