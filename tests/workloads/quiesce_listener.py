#!/usr/bin/env python3
"""A process that opts into memsnap's quiesce hooks, for the tests: it logs every request it answers.

--mode ack       callbacks on the listener's thread acknowledge (after --delay seconds)
--mode refuse    the quiesce callback raises: the checkpoint must be refused with its message
--mode silent    safe points, but the main thread never gets to one: no answer
--mode safepoint the main thread polls requested() and acknowledges, then waits for resume
--children N     also start N children that listen too (a tree of listeners)
Lines on stdout: "ready PID", then "quiesce CKPT", "resume CKPT restored=BOOL" as they come.
"""

import argparse
import os
import subprocess
import sys
import time

from memsnap.quiesce.job import QuiesceListener

p = argparse.ArgumentParser()
p.add_argument("--mode", default="ack")
p.add_argument("--delay", type=float, default=0.0)
p.add_argument("--children", type=int, default=0)
p.add_argument("--name", default="")
a = p.parse_args()

kids = [subprocess.Popen([sys.executable, __file__, "--mode", a.mode, "--delay", str(a.delay),
                          "--name", f"{a.name or 'root'}-kid{i}"]) for i in range(a.children)]


def say(text: str) -> None:
    print(text, flush=True)


def on_quiesce(msg: dict) -> None:
    time.sleep(a.delay)
    if a.mode == "refuse":
        raise RuntimeError("NCCL communicator busy: try later")
    say(f"quiesce {msg.get('checkpoint')}")


def on_resume(msg: dict) -> None:
    say(f"resume {msg.get('checkpoint')} restored={msg.get('restored')}")


trust = (0, os.getuid())
if a.mode in ("ack", "refuse"):
    lst = QuiesceListener(on_quiesce, on_resume, name=a.name, trusted_uids=trust)
else:
    lst = QuiesceListener(name=a.name, trusted_uids=trust)
assert lst.start(), "MEMSNAP_QUIESCE_DIR is not set"
say(f"ready {os.getpid()}")
while True:
    if a.mode == "safepoint" and lst.requested():
        say("quiesce (safe point)")
        msg = lst.acknowledge()
        say(f"resume {msg.get('checkpoint')} restored={msg.get('restored')}")
        lst.resumed()
    time.sleep(0.005)
