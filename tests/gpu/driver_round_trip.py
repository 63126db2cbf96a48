#!/usr/bin/env python3
"""lock, checkpoint, restore, unlock one pid through memsnap.gpu's driver backend; prints one JSON line.

Run as a child of the test with a timeout, so that a driver call that never returns cannot hang the run.
"""

import json
import subprocess
import sys
import time

from memsnap.gpu import GpuError, ProcessState, load_driver

pid = int(sys.argv[1])
drv = load_driver()
if drv is None:
    sys.exit("neither libcuda's checkpoint API nor cuda-checkpoint is usable")
row: dict[str, object] = {"driver_path": drv.name, "cuda_api_version": drv.driver_version()}
try:
    t0 = time.monotonic()
    drv.lock(pid, 30_000)
    t1 = time.monotonic()
    drv.checkpoint(pid)
    t2 = time.monotonic()
    row["state_after_checkpoint"] = drv.get_state(pid).name
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                          text=True, check=False).stdout.split()
    row["gpu_released_while_checkpointed"] = str(pid) not in apps
    t3 = time.monotonic()
    drv.restore(pid)
    t4 = time.monotonic()
    drv.unlock(pid)
    t5 = time.monotonic()
except GpuError as exc:  # say what the driver said, and give the process back if we can
    try:
        row["state"] = drv.get_state(pid).name
    except GpuError as again:
        row["state"] = str(again)
    print(json.dumps({**row, "error": str(exc)}), flush=True)
    for undo in (drv.restore, drv.unlock):
        try:
            undo(pid)
        except GpuError:
            pass
    sys.exit(1)
row["state_after_unlock"] = drv.get_state(pid).name
row.update(lock_s=round(t1 - t0, 3), checkpoint_s=round(t2 - t1, 3), restore_s=round(t4 - t3, 3),
           unlock_s=round(t5 - t4, 3))
print(json.dumps(row), flush=True)
sys.exit(0 if row["state_after_unlock"] == ProcessState.RUNNING.name else 1)
