"""memsnapctl's checkpoint commands: checkpoint, restore, list, show, watch, evict, delete and gc."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click

from memsnap.cli.core import (
    SKIP_IN_FLIGHT,
    Ctx,
    Failure,
    ckpt_dict,
    command_of,
    duration_arg,
    handle_errors,
    say_in_job,
    state_name,
)
from memsnap.cli_fmt import Progress, age, human_bytes, human_ms, table, timestamp, to_json, to_yaml

if TYPE_CHECKING:
    from memsnap.client import MemsnapClient
    from memsnap.v1 import memsnap_pb2 as pb


def _ckpt_summary(d: dict[str, Any]) -> str:
    where = "tier" if d.get("in_tier") else ""
    where += ("+store" if where else "store") if d.get("in_store") else ""
    return (f"{d['id']}: {d['state']}, {human_bytes(d['size_bytes'])}, job frozen {human_ms(d['frozen_ms'])}"
            f" (dump {human_ms(d['dump_ms'])})" + (f", in {where}" if where else ""))


@click.command("checkpoint")
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
    keep: dict[str, Any] = {"keep_last": keep_last, "keep_within_s": duration_arg(keep_within, "--keep-within"),
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


@click.command("restore")
@click.argument("checkpoint_id", metavar="CHECKPOINT|JOB|CONTAINER")
@click.option("--lazy", is_flag=True, help="resume at once; memory is paged in on demand")
@click.option("--gpu-map", default="", help="OLD_UUID=NEW_UUID,... to remap GPUs")
@click.option("--tcp-established", is_flag=True, help="restore established TCP connections")
@click.option("--into", default="", metavar="podman:NAME",
              help="a container's checkpoint: the placeholder container to start from its image and restore into")
@click.pass_obj
@handle_errors
def restore_cmd(obj: Ctx, checkpoint_id: str, lazy: bool, gpu_map: str, tcp_established: bool, into: str) -> None:
    """Verify a checkpoint (or a job's or a container's newest one) and restore it detached.

    A container's checkpoint (memsnapctl checkpoint podman:NAME) goes --into a new placeholder container, started
    from the same image with the same init; its logs go on there. A fetch from the store shows its progress on
    stderr (rate and ETA; -o json: one object per update)."""
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
                                        op_id=op, into=into), obj.json)
    chosen = r.job.restored_from or checkpoint_id
    fetched = f", fetched from the store in {human_ms(r.fetch_ms)}" if r.from_store else ""
    if lazy:  # (from the store: only the small files came first, docs/lazy-store.md)
        fetched += "; its memory pages in lazily"
    placed = f" into container {into.partition(':')[2]}" if into else ""
    obj.emit({"pid": int(r.pid), "job": r.job.id, "checkpoint": chosen, "requested": checkpoint_id,
              "restore_ms": int(r.restore_ms), "verify_ms": int(r.verify_ms), "fetch_ms": int(r.fetch_ms),
              "from_store": r.from_store, **({"into": into} if into else {})},
             f"restored {chosen}{placed} as {r.job.id} (pid {r.pid}) in {human_ms(r.restore_ms)} "
             f"(verify {human_ms(r.verify_ms)}{fetched})")


def _location(k: pb.CheckpointInfo) -> str:
    return "+".join(w for w, on in (("tier", k.in_tier), ("store", k.in_store)) if on) or "-"


@click.command("list")
@click.option("--job", default="", help="only this job's checkpoints, or this container's (podman:NAME, cri:NAME)")
@click.pass_obj
@handle_errors
def list_cmd(obj: Ctx, job: str) -> None:
    """Checkpoints, oldest first."""
    with obj.client() as c:
        cks = c.list(job)
    rows, wide = [], []
    for k in cks:
        row = [k.id, k.name or "-", state_name(k.state), k.job or k.container or str(k.pid),
               human_bytes(k.logical_bytes), *_stored_cols(k), _location(k), age(k.created_unix_ms)]
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


@click.command("show")
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
        *([f"container   {k.container} (restore it --into {k.container.partition(':')[0]}:NEWNAME)"]
          if k.container else []),
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


@click.command("delete")
@click.argument("checkpoint_ids", nargs=-1, required=True, metavar="CHECKPOINT...")
@click.pass_obj
@handle_errors
def delete_cmd(obj: Ctx, checkpoint_ids: tuple[str, ...]) -> None:
    """Delete checkpoints from the tier, the store and the catalog."""
    with obj.client() as c:
        for ckpt in checkpoint_ids:
            note = c.delete(ckpt).note  # (another node's stored copy stays: only this node's row went)
            obj.emit({"deleted": ckpt, **({"note": note} if note else {})}, note or f"deleted {ckpt}")


@click.command("evict")
@click.argument("checkpoint_id")
@click.pass_obj
@handle_errors
def evict_cmd(obj: Ctx, checkpoint_id: str) -> None:
    """Drop the tier copy of a durable checkpoint (the stored copy stays)."""
    with obj.client() as c:
        k = c.evict(checkpoint_id)
    obj.emit(ckpt_dict(k), f"evicted {checkpoint_id} from the tier; it stays durable in the store")


@click.command("watch")
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


@click.command("gc")
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
