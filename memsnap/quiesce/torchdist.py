"""torch.distributed jobs under memsnap checkpoints: the default process group is torn down at a step boundary
all ranks agree on, before memsnapd locks the GPU and dumps, and re-created after it says resume (on this node
or, restored, on another). A live NCCL communicator cannot be checkpointed (NVIDIA/cuda-checkpoint#30); gloo's
TCP connections would not survive a restore either.

    pg = torchdist.init_process_group("nccl", rank=rank, world_size=n, init_method="tcp://10.0.0.1:29500")
    for step in ...:
        pg.safe_point()          # every rank, at a step boundary: the one call that checkpoints need
        ... all_reduce ...

Without $MEMSNAP_QUIESCE_DIR (not under memsnap) safe_point() only counts steps. torch is imported when first
needed (memsnap itself does not depend on it).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from memsnap.quiesce.job import QuiesceListener

log = logging.getLogger(__name__)


def _torch() -> tuple[Any, Any]:
    return importlib.import_module("torch"), importlib.import_module("torch.distributed")


def fresh_init_method(init_method: str, generation: int) -> str:
    """A rendezvous nobody used yet for the generation-th re-creation: file:///p -> file:///p.N, tcp://h:P -> P+N
    (env:// and others: unchanged; pass init= then)."""
    if generation == 0:
        return init_method
    u = urlsplit(init_method)
    if u.scheme == "file":
        return urlunsplit(u._replace(path=f"{u.path}.{generation}"))
    if u.scheme == "tcp" and u.port is not None:
        return urlunsplit(u._replace(netloc=f"{u.hostname}:{u.port + generation}"))
    return init_method


class ProcessGroups:
    """The default process group of this rank, torn down and re-created around memsnap's checkpoints.

    init(generation) creates it (generation 0 at once, 1, 2, ... after each checkpoint); teardown() ends it
    (default: torch.distributed.destroy_process_group; an NCCL >= 2.29.7 job may suspend its communicators
    instead and resume them in init). every: agree only every Nth safe point (one tiny all_reduce each time).
    """

    def __init__(self, init: Callable[[int], None], teardown: Callable[[], None] | None = None, every: int = 1,
                 listener: QuiesceListener | None = None) -> None:
        self._init = init
        self._teardown = teardown
        self.every = max(1, every)
        self.generation = 0
        self.checkpoints = 0
        self._steps = 0
        self.listener = listener if listener is not None else QuiesceListener(name=f"rank{_env_rank()}")
        init(0)
        self.enabled = self.listener.start()

    def safe_point(self) -> bool:
        """Call in every rank at the same step boundary; True when the job was checkpointed here (the process
        group is a new one now)."""
        self._steps += 1
        if not self.enabled or self._steps % self.every:
            return False
        torch, dist = _torch()
        flag = torch.tensor([1 if self.listener.requested() else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # all ranks quiesce here, or none
        if not int(flag.item()):
            return False
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # nothing in flight on the device when its GPU is locked
        (self._teardown or dist.destroy_process_group)()
        resume = self.listener.acknowledge()
        self.generation += 1
        self.checkpoints += 1
        try:
            self._init(self.generation)
        finally:
            self.listener.resumed()
        log.info("process group re-created after checkpoint %s (restored: %s)", resume.get("checkpoint"),
                 resume.get("restored"))
        return True

    def close(self) -> None:
        """Stops listening (the process group stays)."""
        self.listener.close()


def _env_rank() -> str:
    import os

    return os.environ.get("RANK", str(os.getpid()))


def init_process_group(backend: str, *, rank: int, world_size: int, init_method: str, every: int = 1,
                       **kw: Any) -> ProcessGroups:
    """torch.distributed.init_process_group(backend, init_method=..., rank=..., world_size=..., **kw), made
    checkpointable: each re-creation uses a fresh rendezvous (fresh_init_method). Call pg.safe_point() per step."""

    def init(generation: int) -> None:
        _, dist = _torch()
        dist.init_process_group(backend, init_method=fresh_init_method(init_method, generation), rank=rank,
                                world_size=world_size, **kw)

    return ProcessGroups(init, every=every, listener=QuiesceListener(name=f"rank{rank}"))
