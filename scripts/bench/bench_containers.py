#!/usr/bin/env python3
"""Containers (issue 33): memsnap's checkpoint and restore of a podman container beside podman's own.

Per size and rep, on fresh containers of the test image (scripts/containers/build-test-image.sh), each holding
MiB of random memory (tests/workloads/memtick.c):
  podman:  `podman container checkpoint NAME` (CRIU via runc, the image kept in podman's storage; the container
           stops), then `podman container restore NAME` (same container, same namespaces).
  memsnap: Checkpoint("podman:NAME", stop) into the tier, Restore(--into a new placeholder) from the tier; then a
           checkpoint made durable, its tier copy evicted, caches dropped, and Restore(--into) from the store.
  CRI:     the same two restores of a pod's container (containerd, scripts/containers/containerd.sh), each into a new
           placeholder pod made through CRI.
Every restore is checked: the workload's next digest line equals its first. Medians with (min-max).

    scripts/bench/bench_containers.py [--mib 256,1024] [--reps 3] [--out bench/results/containers]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.helpers import DaemonProc, wait_for  # noqa: E402


def podman(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=600, check=True)


def logs(name: str) -> str:
    r = subprocess.run(["podman", "logs", name], capture_output=True, text=True, timeout=60)
    return r.stdout


def digests(text: str) -> list[tuple[int, str]]:
    return [(int(m.group(1)), m.group(2)) for m in re.finditer(r"^tick (\d+) ([0-9a-f]{16}) fresh$", text, re.M)]


def start(image: str, name: str, mib: int) -> str:
    podman("run", "-d", "--name", name, "--network", "none", image, "/memtick", "reap", "/memtick", "--mib", str(mib),
           "--interval-ms", "100", "--digest-every", "5")
    wait_for(lambda: digests(logs(name)), 120, what=f"{name} to tick")
    m = re.search(r"^start ([0-9a-f]{16})$", logs(name), re.M)
    assert m
    return m.group(1)


def went_on(name: str, digest: str, after: int = 0) -> None:
    wait_for(lambda: any(t > after for t, _ in digests(logs(name))), 120, what=f"{name} to go on")
    got = {d for t, d in digests(logs(name)) if t > after}
    assert got == {digest}, f"{name}: memory changed ({got} != {digest})"


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def timed(fn: Any) -> tuple[float, Any]:
    t0 = time.monotonic()
    out = fn()
    return time.monotonic() - t0, out


def one(d: DaemonProc, image: str, mib: int) -> dict[str, float]:
    tag = secrets.token_hex(3)
    out: dict[str, float] = {}
    # podman's own
    name = f"bp-{tag}"
    digest = start(image, name, mib)
    out["podman_checkpoint_s"], _ = timed(lambda: podman("container", "checkpoint", name))
    last = max(t for t, _ in digests(logs(name)))
    out["podman_restore_s"], _ = timed(lambda: podman("container", "restore", name))
    went_on(name, digest, last)
    podman("rm", "-f", "-t", "0", name)
    # memsnap's: from the tier, then from the store
    src, dst, dst2, dst3 = f"bm-{tag}", f"bm-{tag}-r", f"bm-{tag}-s", f"bm-{tag}-l"
    digest = start(image, src, mib)
    with d.client() as c:
        t, ck = timed(lambda: c.checkpoint(f"podman:{src}", stop=True))
        out["memsnap_checkpoint_s"], out["memsnap_frozen_s"] = t, ck.frozen_ms / 1000
        t, r = timed(lambda: c.restore(ck.id, into=f"podman:{dst}"))
        out["memsnap_restore_tier_s"], out["memsnap_criu_restore_s"] = t, r.restore_ms / 1000
        out["memsnap_placeholder_s"] = next((p.ms for p in r.phases if p.name == "placeholder"), 0) / 1000
        went_on(dst, digest)
        podman("rm", "-f", "-t", "0", src)
        ck2 = c.checkpoint(f"podman:{dst}", stop=True, wait_durable=True)
        c.evict(ck2.id)
        drop_caches()
        t, r = timed(lambda: c.restore(ck2.id, into=f"podman:{dst2}"))
        out["memsnap_restore_store_s"], out["memsnap_fetch_s"] = t, r.fetch_ms / 1000
        went_on(dst2, digest)
        # lazy from the store: the call returns once the tree runs; its memory is paged in from the store after
        ck3 = c.checkpoint(f"podman:{dst2}", stop=True, wait_durable=True)
        c.evict(ck3.id)
        drop_caches()
        t0 = time.monotonic()
        r = c.restore(ck3.id, into=f"podman:{dst3}", lazy=True)
        out["memsnap_lazy_store_s"] = time.monotonic() - t0
        last = max((t for t, _ in digests(logs(dst3))), default=0)
        went_on(dst3, digest, last)
        out["memsnap_lazy_store_digest_s"] = time.monotonic() - t0
        for ident in (ck.id, ck2.id, ck3.id):
            c.delete(ident)
    for n in (dst, dst2, dst3):
        podman("rm", "-f", "-t", "0", n)
    return out


def cri_logs(name: str) -> str:
    try:
        text = Path(f"/var/log/memsnap-pods/{name}/{name}.log").read_text()
    except OSError:
        return ""
    return "\n".join(ln.split(" F ", 1)[1] for ln in text.splitlines() if " F " in ln)


def cri_went_on(name: str, digest: str) -> None:
    wait_for(lambda: digests(cri_logs(name)), 120, what=f"{name} to go on")
    got = {d for _, d in digests(cri_logs(name))}
    assert got == {digest}, f"{name}: memory changed ({got} != {digest})"


def one_cri(d: DaemonProc, image: str, mib: int) -> dict[str, float]:
    from memsnap import cri

    tag = secrets.token_hex(3)
    src, dst, dst2 = f"bc-{tag}", f"bc-{tag}-r", f"bc-{tag}-s"
    cid, _ = cri.run_placeholder(image, ["/memtick", "reap", "/memtick", "--mib", str(mib), "--interval-ms", "100",
                                         "--digest-every", "5"], "bench", src, "")
    wait_for(lambda: digests(cri_logs(src)), 120, what=f"{src} to tick")
    m = re.search(r"^start ([0-9a-f]{16})$", cri_logs(src), re.M)
    assert m
    digest, out = m.group(1), {}
    with d.client() as c:
        t, ck = timed(lambda: c.checkpoint(f"cri:{cid}", stop=True))
        out["cri_checkpoint_s"] = t
        t, r = timed(lambda: c.restore(ck.id, into=f"cri:{dst}"))
        out["cri_restore_tier_s"] = t
        out["cri_placeholder_s"] = next((p.ms for p in r.phases if p.name == "placeholder"), 0) / 1000
        cri_went_on(dst, digest)
        ck2 = c.checkpoint(f"cri:{dst}", stop=True, wait_durable=True)
        c.evict(ck2.id)
        drop_caches()
        t, r = timed(lambda: c.restore(ck2.id, into=f"cri:{dst2}"))
        out["cri_restore_store_s"] = t
        cri_went_on(dst2, digest)
        for ident in (ck.id, ck2.id):
            c.delete(ident)
    with cri.Client() as cl:
        for pod in cl.call("ListPodSandbox", cl.api.ListPodSandboxRequest()).items:
            if pod.metadata.name in (src, dst, dst2):
                cri.remove(pod.id)
    for n in (src, dst, dst2):
        subprocess.run(["rm", "-rf", f"/var/log/memsnap-pods/{n}"], check=False)
    return out


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", default="256,1024")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "containers"))
    a = ap.parse_args()
    image = subprocess.run([str(REPO / "scripts" / "containers" / "build-test-image.sh")], capture_output=True,
                           text=True, check=True).stdout.split()[-1]
    base = Path("/var/tmp/memsnap-bench-containers")
    subprocess.run(["rm", "-rf", str(base)], check=True)
    ctd = base / "containerd"
    script = str(REPO / "scripts" / "containers" / "containerd.sh")
    subprocess.run([script, "start", str(ctd)], capture_output=True, check=True)
    os.environ["CONTAINER_RUNTIME_ENDPOINT"] = f"unix://{ctd / 'containerd.sock'}"
    d = DaemonProc(base / "d", env={"CONTAINER_RUNTIME_ENDPOINT": os.environ["CONTAINER_RUNTIME_ENDPOINT"]}).start()
    load0 = os.getloadavg()
    t0 = time.time()
    results: dict[int, list[dict[str, float]]] = {}
    try:
        for rep in range(a.reps):
            for mib in (int(x) for x in a.mib.split(",")):
                results.setdefault(mib, []).append({**one(d, image, mib), **one_cri(d, image, mib)})
                print(f"rep {rep} {mib} MiB: {results[mib][-1]}", file=sys.stderr)
    finally:
        d.cleanup()
        subprocess.run([script, "stop", str(ctd)], capture_output=True)
    load1 = os.getloadavg()
    podman_v = podman("--version").stdout.strip()
    rows = [("podman container checkpoint (CLI wall)", "podman_checkpoint_s"),
            ("memsnap Checkpoint podman:NAME --stop (RPC wall, into the tier)", "memsnap_checkpoint_s"),
            ("... of which the workload was frozen (CRIU)", "memsnap_frozen_s"),
            ("podman container restore (CLI wall)", "podman_restore_s"),
            ("memsnap Restore --into, from the tier (RPC wall, placeholder started)", "memsnap_restore_tier_s"),
            ("... of which CRIU's restore", "memsnap_criu_restore_s"),
            ("... and the placeholder's start (podman run)", "memsnap_placeholder_s"),
            ("memsnap Restore --into, from the store (evicted, caches dropped)", "memsnap_restore_store_s"),
            ("... of which the fetch", "memsnap_fetch_s"),
            ("memsnap Restore --into --lazy, from the store (evicted, caches dropped): running",
             "memsnap_lazy_store_s"),
            ("... until its next digest of all its memory (every page in; it digests every 0.5 s)",
             "memsnap_lazy_store_digest_s"),
            ("CRI (containerd): memsnap Checkpoint cri:ID --stop", "cri_checkpoint_s"),
            ("CRI: Restore --into a new placeholder pod, from the tier", "cri_restore_tier_s"),
            ("... of which the placeholder pod's start (RunPodSandbox, CreateContainer, StartContainer)",
             "cri_placeholder_s"),
            ("CRI: Restore --into a new placeholder pod, from the store (evicted, caches dropped)",
             "cri_restore_store_s")]
    sizes = sorted(results)
    lines = [
        "# Containers: memsnap beside podman's own checkpoint/restore (issue 33)", "",
        f"Generated by `scripts/bench/bench_containers.py --mib {a.mib} --reps {a.reps}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(t0))} ({(time.time() - t0) / 60:.1f} min). "
        f"Seconds, median of {a.reps} (min-max). {podman_v} with runc, CRIU "
        f"4.1.1 (ours, both); kernel {platform.release()}; 2-core VM; load average "
        f"{load0[0]:.2f} at the start, {load1[0]:.2f} at the end. Raw data: `containers.json`.", "",
        "Every restore was checked: the workload's digest of its memory after the restore equals its first.", "",
        "| path | " + " | ".join(f"{m} MiB" for m in sizes) + " |",
        "|---|" + "---:|" * len(sizes)]
    for label, key in rows:
        lines.append(f"| {label} | " + " | ".join(med([r[key] for r in results[m]]) for m in sizes) + " |")
    lines += ["", "podman keeps the container (its namespaces, its IP) and restores into it; memsnap restores into a "
              "new placeholder container it starts from the same image (`podman run`), "
              "with the tier, the drain to the store and the store behind it. containerd 1.6 (CRI) has no "
              "checkpoint/restore of its own to compare with (its CRI answers UNIMPLEMENTED)."]
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    Path(a.out + ".json").write_text(json.dumps({"mib": sizes, "reps": a.reps, "results": results,
                                                 "load": [load0, load1], "podman": podman_v}, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
