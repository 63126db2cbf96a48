#!/usr/bin/env python3
"""Wall-clock checks moved out of the unit tests (which use an injected clock): the drain bandwidth cap holds
on a real clock, alone and shared by threads, and an unreachable S3 endpoint fails fast.

    PYTHONPATH=. python3 scripts/bench/bench_throttle.py    # prints JSON; exits 1 if a bound is missed
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

from memsnap.store.throttle import Throttle

KiB, MiB = 1 << 10, 1 << 20


def single() -> float:
    t = Throttle(8 * MiB)  # burst 1 MiB: 4 MiB take about 3/8 s
    start = time.monotonic()
    for _ in range(64):
        t.consume(64 * KiB)
    return time.monotonic() - start


def shared() -> float:
    t = Throttle(16 * MiB)  # burst 1.6 MiB: 8 MiB from 4 threads take about 0.4 s

    def drain() -> None:
        for _ in range(16):
            t.consume(128 * KiB)

    threads = [threading.Thread(target=drain) for _ in range(4)]
    start = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.monotonic() - start


def s3_unreachable() -> float:
    from memsnap.store import StoreUnavailable
    from memsnap.store.s3 import S3Store

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = S3Store("bucket", "p", endpoint_url=f"http://127.0.0.1:{port}", region="us-east-1", access_key="a",
                    secret_key="b", connect_timeout=0.5, read_timeout=0.5, max_attempts=1)
    start = time.monotonic()
    try:
        store.check()
    except StoreUnavailable:
        pass
    return time.monotonic() - start


def main() -> int:
    got = {"throttle_4MiB_at_8MiBps_s": single(), "throttle_8MiB_4_threads_at_16MiBps_s": shared(),
           "s3_unreachable_check_s": s3_unreachable()}
    bounds = {"throttle_4MiB_at_8MiBps_s": (0.3, 1.0), "throttle_8MiB_4_threads_at_16MiBps_s": (0.3, 1.2),
              "s3_unreachable_check_s": (0.0, 5.0)}
    ok = all(lo <= got[k] <= hi for k, (lo, hi) in bounds.items())
    print(json.dumps({"results": got, "bounds": bounds, "ok": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
