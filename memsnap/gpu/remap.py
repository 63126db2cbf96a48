"""Which GPUs a CUDA process had at checkpoint time, and the complete UUID pairs for its restore.

cuCheckpointProcessRestore: "If an array of GPU UUID pairs is specified, it must contain every
checkpointed GPU" (`cuda-checkpoint --help`: "Must contain all checkpointed devices if specified").
A partial map fails with "invalid argument" (NVIDIA/cuda-checkpoint#35), and the CRIU example for
its device map lists every GPU of the node. The checkpointed GPUs of a process are the GPUs its
driver instance enumerates: all GPUs of the node, or those CUDA_VISIBLE_DEVICES leaves it. So the
manifest records them per process at dump time (visible_gpus), and a restore that remaps anything
sends one pair per checkpointed GPU: the user's pairs, and identity pairs for the rest. The map is
checked against this node's GPUs first: each target present, used once, and of the same model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from memsnap.errors import InvalidArgument
from memsnap.gpu.bindings import uuid_bytes
from memsnap.gpu.errors import GpuPreflightError

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


def _key(uuid: str) -> bytes:
    """Comparable form of a GPU UUID ('GPU-…' or bare, any case)."""
    return uuid_bytes(uuid)


def _named(gpus: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The GPUs whose uuid parses (nvidia-smi may print [N/A]): the others cannot be named in a pair."""
    out = []
    for g in gpus:
        try:
            _key(str(g.get("uuid")))
        except ValueError:
            continue
        out.append(g)
    return out


def _environ(pid: int, proc_root: str) -> dict[str, str] | None:
    """pid's environment, None when unreadable."""
    try:
        raw = Path(proc_root, str(pid), "environ").read_bytes()
    except OSError:
        return None
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep:
            env[name.decode(errors="replace")] = value.decode(errors="replace")
    return env


def select_visible(node_gpus: Sequence[Mapping[str, Any]], visible: str | None) -> list[dict[str, Any]]:
    """The node's GPUs a CUDA_VISIBLE_DEVICES value leaves, in CUDA's order ({"uuid", "model"} each).

    Unset: every GPU. Entries are indices or (prefixes of) GPU UUIDs; as in CUDA, the first entry
    that matches nothing ends the list. A MIG entry, which memsnap refuses anyway, keeps all GPUs.
    """
    gpus = sorted(node_gpus, key=lambda g: int(g["index"]) if isinstance(g.get("index"), int) else 0)
    every = [{"uuid": g["uuid"], "model": g.get("name")} for g in gpus]
    if visible is None:
        return every
    out: list[dict[str, Any]] = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry.upper().startswith("MIG-"):
            return every
        if entry.isdigit():
            found = [g for g in gpus if g.get("index") == int(entry)]
        else:
            want = entry.lower() if entry.upper().startswith("GPU-") else f"gpu-{entry.lower()}"
            found = [g for g in gpus if entry and str(g["uuid"]).lower().startswith(want)]
        if len(found) != 1:
            break
        g = found[0]
        if all(o["uuid"] != g["uuid"] for o in out):
            out.append({"uuid": g["uuid"], "model": g.get("name")})
    return out


def visible_gpus(pid: int, node_gpus: Sequence[Mapping[str, Any]], proc_root: str = "/proc") -> list[dict[str, Any]]:
    """The GPUs pid's CUDA driver enumerates: the node's, narrowed by its CUDA_VISIBLE_DEVICES."""
    env = _environ(pid, proc_root)
    return select_visible(node_gpus, None if env is None else env.get(VISIBLE_ENV))


def checkpointed_gpus(entries: Iterable[Mapping[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """ns pid -> checkpointed GPUs from the manifest's "gpus" (visible_gpus; older manifests: gpus used)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for e in entries:
        gpus = e.get("visible_gpus")
        if gpus is None:
            gpus = [{"uuid": g["uuid"], "model": g.get("model")} for g in e.get("gpus", []) if g.get("uuid")]
        out[int(e.get("ns_pid", e.get("pid", 0)))] = [dict(g) for g in gpus]
    return out


def _checked_map(gpu_map: Mapping[str, str] | None) -> dict[bytes, tuple[str, str]]:
    """old key -> (old, new) for every entry, InvalidArgument for a malformed or ambiguous one."""
    out: dict[bytes, tuple[str, str]] = {}
    targets: dict[bytes, str] = {}
    for old, new in (gpu_map or {}).items():
        try:
            k_old, k_new = _key(old), _key(new)
        except ValueError as exc:
            raise InvalidArgument(f"bad GPU map entry {old!r} -> {new!r}: {exc}") from None
        if k_new in targets and targets[k_new] != old:
            raise InvalidArgument(f"bad GPU map: {targets[k_new]} and {old} both map onto {new}")
        targets[k_new] = old
        out[k_old] = (old, new)
    return out


def restore_pairs(
    checkpointed: Mapping[int, Sequence[Mapping[str, Any]]],
    gpu_map: Mapping[str, str] | None,
    node_gpus: Sequence[Mapping[str, Any]],
) -> dict[int, list[tuple[str, str]]]:
    """Per pid, the complete (old, new) UUID pairs to restore with; {} when nothing moves.

    Refuses (before any driver call) a map entry for a GPU the checkpoint did not use, two GPUs
    mapped onto one, a target that is not on this node, and a target of another model.
    """
    wanted = _checked_map(gpu_map)
    checkpointed = {pid: _named(gpus) for pid, gpus in checkpointed.items()}
    node_gpus = _named(node_gpus)
    if not node_gpus and not wanted:
        return {}  # nvidia-smi told us nothing: restore in place and let the driver judge
    used: dict[bytes, Mapping[str, Any]] = {}
    for gpus in checkpointed.values():
        for g in gpus:
            used.setdefault(_key(str(g["uuid"])), g)
    node = {_key(str(g["uuid"])): g for g in node_gpus}
    names = ", ".join(f"{g['uuid']} ({g.get('name')})" for g in node_gpus) or "none"
    for k, (old, _) in wanted.items():
        if k not in used:
            had = ", ".join(str(g["uuid"]) for g in used.values()) or "none recorded"
            raise InvalidArgument(f"--gpu-map names {old}, which this checkpoint did not use (it used: {had})")
    new_of: dict[bytes, tuple[str, bytes]] = {}
    for k, g in used.items():
        new, k_new = (wanted[k][1], _key(wanted[k][1])) if k in wanted else (str(g["uuid"]), k)
        target = node.get(k_new)
        if target is None:
            moved = f" (mapped to {new})" if k_new != k else ""
            raise GpuPreflightError(
                f"GPU {g['uuid']} ({g.get('model')}) of this checkpoint{moved} is not on this node: restore "
                f"with --gpu-map {g['uuid']}=NEW_UUID for each such GPU, choosing among {names}"
            )
        if g.get("model") and target.get("name") and g["model"] != target["name"]:
            raise GpuPreflightError(
                f"cannot restore GPU {g['uuid']} ({g['model']}) onto {new} ({target['name']}): CUDA restores "
                "only onto the same GPU model; pick a GPU of that model with --gpu-map"
            )
        new_of[k] = (str(target["uuid"]), k_new)
    taken: dict[bytes, bytes] = {}
    for k, (_, k_new) in new_of.items():
        if k_new in taken:
            raise InvalidArgument(
                f"GPUs {used[taken[k_new]]['uuid']} and {used[k]['uuid']} would both be restored onto "
                f"{new_of[k][0]}: map each checkpointed GPU onto its own GPU"
            )
        taken[k_new] = k
    if all(k == k_new for k, (_, k_new) in new_of.items()):
        return {}
    return {
        pid: [(str(g["uuid"]), new_of[_key(str(g["uuid"]))][0]) for g in gpus] for pid, gpus in checkpointed.items()
    }
