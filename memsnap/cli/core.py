"""What every memsnapctl command shares: the global options' context (Ctx), exit codes and failures (fail),
the -o json shapes of checkpoints and jobs, and shared options. Imports only click, the standard library and
memsnap.cli_fmt at start-up: gRPC loads when a command talks to the daemon."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from memsnap.cli_fmt import Progress, printable, printable_lines, to_json, to_yaml

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


def to_dict(msg: Any) -> dict[str, Any]:
    """A message as plain data (proto field names, every field)."""
    from google.protobuf.json_format import MessageToDict

    d: dict[str, Any] = MessageToDict(msg, preserving_proto_field_name=True,
                                      always_print_fields_with_no_presence=True)
    return d


def ckpt_dict(c: pb.CheckpointInfo) -> dict[str, Any]:
    """A checkpoint as plain JSON-able data, with the state as a lower-case word."""
    d = to_dict(c)
    d["state"] = state_name(c.state)
    for k in ("pid", "created_unix_ms", "size_bytes", "frozen_ms", "dump_ms", "drained_bytes", "stored_bytes",
              "durable_unix_ms", "logical_bytes", "new_bytes", "host_bytes", "device_bytes"):
        d[k] = int(d.get(k, 0))
    for k in ("phases", "restore_phases"):
        d[k] = [{"name": p.name, "ms": int(p.ms)} for p in getattr(c, k)]
    return d


def job_dict(j: pb.Job) -> dict[str, Any]:
    """A job as plain data."""
    d = to_dict(j)
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
            failure = as_failure(exc)
            if failure is None:
                raise
            raise failure from None

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper  # type: ignore[return-value]


def as_failure(exc: BaseException) -> Failure | None:
    """The Failure that exc is (a Failure, or the client's ClientError), else None."""
    if isinstance(exc, Failure):
        return exc
    client = sys.modules.get("memsnap.client")
    if client is not None and isinstance(exc, client.ClientError):
        return Failure(exc.code.name, exc.message)
    return None


def say_in_job(obj: Ctx, data: dict[str, Any], target: str, job_id: str, job_name: str, job_pid: int,
               done: str) -> None:
    """A pid inside a job named the whole job (memsnap.resolve): says so on stderr, and as "note" in the JSON."""
    from memsnap.resolve import in_job_note

    note = in_job_note(target, job_id, job_name, job_pid, done)
    if note:
        data["note"] = note
        if not obj.json:
            click.echo(printable(note), err=True)


# checkpoint and migrate: what a dump does with a connection still in a listener's accept queue.
SKIP_IN_FLIGHT = click.option(
    "--skip-in-flight/--fail-on-in-flight", default=True, show_default=True,
    help="leave out connections still in a listener's accept queue (a busy server's: their clients see a reset, "
         "as after a restart), or fail on one")


def duration_arg(text: str | None, hint: str) -> float | None:
    """'30m', '2h', '7d' -> seconds (None stays None)."""
    if text is None:
        return None
    from memsnap.retention import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=hint) from None


def fail(code: str, message: str, output: str = "table") -> NoReturn:
    """Prints an error (one line; a JSON object with -o json) on stderr and exits with its status."""
    f = Failure(code, message)
    if output in ("json", "yaml"):
        click.echo(to_json({"error": {"code": code, "message": message, "exit_code": f.exit_code}}), err=True)
    else:
        click.echo(f"memsnapctl: {code}: {printable(message)}", err=True)
    sys.exit(f.exit_code)
