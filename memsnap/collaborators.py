"""What the engine is wired with, as the engine and its parts see it: its config (EngineConfig) and the small
protocols of the daemon's services it calls back (the drain, the GPU, the memory guard).

They live here, not in memsnap.engine, because the engine's parts (checkpointer, restorer, recovery, jobtable) and
the move code name them too, and those cannot import the engine (it imports them). They are protocols, not the
services' classes, because the services import the engine (memsnap.guard), or must stay unloaded on CPU-only
nodes (memsnap.gpu). This module imports only the catalog's and the manifest's types: anything may import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from memsnap.catalog import CheckpointRecord, JobRecord
from memsnap.manifest import Manifest


@dataclass
class EngineConfig:
    """Where things live and how to size reservations."""

    state_dir: Path
    reserve_margin: float = 0.10
    gpu_lock_timeout_ms: int = 10_000
    extra_dump_opts: dict[str, Any] = field(default_factory=dict)
    # Jobs get a /tmp of their own unless they ask for the host's (memsnap.mounts; README "Private /tmp").
    private_tmp: bool = True
    node_name: str = ""  # daemon.node_name: who made a stored copy (retention.not_ours); "" = the host name


class Uploads(Protocol):
    """What the engine needs from the drain (memsnap.drain), the upload scheduler; everything else about the
    store goes through the repository (memsnap.repository)."""

    def enqueue(self, ckpt_id: str) -> None:
        """Queues a staged checkpoint for draining."""


class GpuSuspension(Protocol):
    """A tree's CUDA state while it is checkpointed (memsnap.gpu.checkpointer.GpuSuspension)."""

    @property
    def seconds(self) -> dict[str, float]:
        """Wall time of each stage so far ({"lock": s, "checkpoint": s})."""

    def resume(self) -> None:
        """Restores and unlocks the CUDA state (the same processes run on)."""

    def release(self) -> None:
        """Forgets the suspension once CRIU has the tree (the processes are gone or held)."""


class GpuAdapter(Protocol):
    """What the engine needs from memsnap.gpu around CRIU."""

    def suspend(self, root_pid: int, timeout_ms: int,
                journal: Callable[[dict[str, Any] | None], None] | None = None) -> GpuSuspension:
        """Locks and checkpoints the CUDA processes of a tree; returns a handle with resume()/release().
        journal(entry) runs before the first lock, journal(None) once all is resumed or released."""

    def restore(self, root_pid: int, gpu_map: dict[str, str] | None,
                checkpointed: list[dict[str, Any]] | None = None) -> dict[str, float] | None:
        """Restores and unlocks CUDA state after CRIU restored the tree (checkpointed: the manifest's gpus);
        the wall time of each stage ({"restore": s, "unlock": s})."""

    def recover(self, entry: dict[str, Any]) -> dict[int, str]:
        """Restores and unlocks the pids of a journal entry that a killed daemon left suspended."""

    def describe(self, root_pid: int) -> list[dict[str, Any]]:
        """GPU model/uuid/driver/device bytes per CUDA process of the tree."""

    def device_bytes(self, root_pid: int) -> int:
        """Device memory the tree's CUDA processes use: what their checkpoint moves into the image."""


class GuardedJobView(Protocol):
    """What gc reads of a guarded job (memsnap.guard.table.GuardedJob)."""

    @property
    def state(self) -> str:
        """running, parked, resumed, ..."""

    @property
    def checkpoint(self) -> str:
        """The checkpoint a parked job is parked on."""


class JobGuard(Protocol):
    """What the engine, its parts and gc use of the memory guard (memsnap.guard.service.Guard)."""

    def get(self, job_id: str) -> GuardedJobView | None:
        """The guard's record of a job, or None when it does not guard it."""

    def settings_of(self, job_id: str) -> dict[str, Any] | None:
        """What a checkpoint of a guarded job carries wherever it is restored (its manifest's "guard")."""

    def restored(self, job: JobRecord, rec: CheckpointRecord, man: Manifest) -> None:
        """A guarded job came back (a restore here, or a move to this node): guard the new job as it was."""
