"""One thread per CUDA process for a stage of driver calls: each GPU has its own link, so a job with a
process per GPU waits for its slowest process, not for the sum of them."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from memsnap.gpu.errors import GpuError


def each_pid(op: str, pids: Sequence[int], call: Callable[[int], None]) -> dict[int, GpuError]:
    """call(pid) for every pid at once, one thread each; pid -> GpuError of those that failed, once every
    call has ended. Any other exception in a call is re-raised here after all calls ended (a bug, not a
    driver's answer)."""
    errors: dict[int, GpuError] = {}
    other: list[BaseException] = []

    def run(pid: int) -> None:
        try:
            call(pid)
        except GpuError as exc:
            errors[pid] = exc
        except BaseException as exc:  # re-raised below, on the caller's thread
            other.append(exc)

    if len(pids) == 1:
        run(pids[0])
    else:
        threads = [threading.Thread(target=run, args=(p,), name=f"gpu-{op}-{p}", daemon=True) for p in pids]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if other:
        raise other[0]
    return {p: errors[p] for p in pids if p in errors}
