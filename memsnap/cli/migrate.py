"""memsnapctl migrate: move a running job to another node's memsnapd."""

from __future__ import annotations

import click

from memsnap.cli.core import SKIP_IN_FLIGHT, Ctx, handle_errors
from memsnap.cli_fmt import human_bytes, human_ms


@click.command("migrate")
@click.argument("target")
@click.option("--to", "to", required=True, metavar="PEER|HOST:PORT",
              help="the target: a configured peer of this node, by name or address")
@click.option("--token-file", "to_token_file", default="",
              help="a credential the target accepts (default: the peer's, from this node's config; "
                   "root only, for an address that is not a configured peer)")
@click.option("--via-store", is_flag=True, help="the target fetches the durable copy from shared storage")
@click.option("--lazy", is_flag=True, help="post-copy: resume on the target at once, pages follow")
@click.option("--plain-restore", is_flag=True,
              help="resume only once all memory is restored (default: resume at once, page in locally)")
@click.option("--tcp-established", is_flag=True,
              help="keep established TCP connections (without it the moved job has them closed: its clients "
                   "reconnect)")
@SKIP_IN_FLIGHT
@click.option("--move-ip", default="", metavar="ADDR/PREFIX",
              help="service address to take from this node and add on the target")
@click.option("--move-ip-dev-source", default="", metavar="DEV", help="device holding --move-ip here")
@click.option("--move-ip-dev-target", default="", metavar="DEV",
              help="device for --move-ip on the target (default: the one in its subnet)")
@click.option("--into", default="", metavar="podman:NAME",
              help="a container (TARGET podman:NAME): the placeholder container to start on the target")
@click.pass_obj
@handle_errors
def migrate_cmd(obj: Ctx, target: str, to: str, to_token_file: str, via_store: bool, lazy: bool,
                plain_restore: bool, tcp_established: bool, skip_in_flight: bool, move_ip: str,
                move_ip_dev_source: str, move_ip_dev_target: str, into: str) -> None:
    """Move a PID, job or container (podman:NAME, with --into) to another node; on failure it runs on here.

    Progress on stderr: bytes sent with rate and ETA, then the restore on the target (-o json: one object
    per update). The job is the target's own afterwards: its name stays, its log is the target's."""
    from memsnap.v1 import memsnap_pb2 as pb

    token = ""
    to_token_file = to_token_file or obj.token_file
    if to_token_file:
        try:
            with open(to_token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as exc:
            raise click.UsageError(f"cannot read --token-file {to_token_file}: {exc.strerror}") from exc
    req = pb.MigrateRequest(target=target, to=to, via_store=via_store, lazy=lazy, plain_restore=plain_restore,
                            move_ip=move_ip,
                            tcp_established=tcp_established, move_ip_dev_source=move_ip_dev_source,
                            move_ip_dev_target=move_ip_dev_target, to_token=token,
                            fail_on_in_flight=not skip_in_flight, into=into)
    from memsnap.cli_follow import follow

    def call(op_id: str) -> pb.MigrateResponse:
        req.op_id = op_id
        return c.migrate(req)

    with obj.client() as c:
        r = follow(c, f"moving {target} to {to}", call, obj.json)
    phases = {p.name: int(p.ms) for p in r.phases}
    steps = ", ".join(f"{k} {v} ms" for k, v in phases.items())
    d = {"target_pid": int(r.target_pid), "target_job": r.target_job, "checkpoint": r.checkpoint_id,
         "downtime_ms": int(r.downtime_ms), "bytes_sent": int(r.bytes_sent), "phases": phases, "to": to}
    if r.note:  # a pid inside a job moved the whole job (memsnap.resolve)
        d["note"] = r.note
        if not obj.json:
            click.echo(r.note, err=True)
    obj.emit(d,
             f"moved {target} to {to}: job {r.target_job} pid {r.target_pid}, "
             + (f"resumed after {human_ms(r.downtime_ms)}, all memory there after "
                f"{human_ms(int(r.downtime_ms) + phases.get('pages', phases.get('paging', 0)))}"
                if "pages" in phases or "paging" in phases else f"downtime {human_ms(r.downtime_ms)}")
             + f", {human_bytes(r.bytes_sent)} sent\nphases: {steps}")
