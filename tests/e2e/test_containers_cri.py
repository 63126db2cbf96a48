"""Pods without a kubelet (issue 33): a container of a pod made through containerd's CRI (RunPodSandbox,
CreateContainer) is checkpointed from the host and restored into a placeholder pod that memsnap makes through CRI,
as a Kubernetes node agent would (docs/kubernetes.md).

containerd runs for these tests only (scripts/containers/containerd.sh: its own root, state, socket and CNI bridge;
the test image imported; no registry); memsnapd finds it through CONTAINER_RUNTIME_ENDPOINT.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_containers import goes_on, in_pidns, ns
from tests.helpers import REPO, assert_node_healthy, wait_for

SCRIPT = REPO / "scripts" / "containers" / "containerd.sh"
PODS = Path("/var/log/memsnap-pods")


@dataclass
class Containerd:
    dir: Path
    image: str

    @property
    def endpoint(self) -> str:
        return f"unix://{self.dir / 'containerd.sock'}"


@pytest.fixture(scope="module")
def containerd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Containerd]:
    d = tmp_path_factory.mktemp("containerd")
    r = subprocess.run([str(SCRIPT), "start", str(d)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    yield Containerd(d, r.stdout.split()[-1])
    subprocess.run([str(SCRIPT), "stop", str(d)], capture_output=True, timeout=120)


@pytest.fixture
def cri(containerd: Containerd, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """memsnap.cri on the test containerd; every pod a test makes (by name) is removed at teardown."""
    from memsnap import cri as mod

    monkeypatch.setenv("CONTAINER_RUNTIME_ENDPOINT", containerd.endpoint)
    made: list[str] = []
    mod.made = made  # type: ignore[attr-defined]
    yield mod
    with mod.Client() as c:
        for pod in c.call("ListPodSandbox", c.api.ListPodSandboxRequest()).items:
            if pod.metadata.name in made:
                mod.remove(pod.id)
    for name in made:
        shutil.rmtree(PODS / name, ignore_errors=True)


def new_pod(cri: Any, what: str) -> str:
    name = f"ms-{what}-{secrets.token_hex(3)}"
    cri.made.append(name)
    return name


def log_of(name: str) -> str:
    try:
        return (PODS / name / f"{name}.log").read_text()
    except OSError:
        return ""


def ticks(text: str) -> list[tuple[int, str, bool]]:
    # CRI log lines: "TIME stdout F tick N DIGEST [fresh]"
    return [(int(m.group(1)), m.group(2), bool(m.group(3)))
            for m in re.finditer(r"^\S+ stdout F tick (\d+) ([0-9a-f]{16})( fresh)?$", text, re.M)]


def pod_names(cri: Any) -> list[str]:
    with cri.Client() as c:
        return [p.metadata.name for p in c.call("ListPodSandbox", c.api.ListPodSandboxRequest()).items]


def running(cri: Any, cid: str) -> bool:
    try:
        cri.inspect(cid)
        return True
    except Exception:
        return False


def test_a_pod_s_container_comes_back_from_the_store_in_a_placeholder_pod_made_through_cri(
        make_daemon: Any, containerd: Containerd, cri: Any, tmp_path: Path) -> None:
    # Its workload holds a file open (fd 3) on a host path the pod mounts at /data: the placeholder mounts it too.
    src, dst = new_pod(cri, "src"), new_pod(cri, "dst")
    cid, _pod = cri.run_placeholder(containerd.image, ["/memtick", "reap", "--", "/bin/sh", "-c",
                                                       "exec 3>>/data/log && exec /memtick --mib 256 "
                                                       "--interval-ms 100 --digest-every 10"],
                                    "trainer-0", src, "", [("/data", str(tmp_path), False)])
    wait_for(lambda: len(ticks(log_of(src))) >= 3, 60, what="the pod's container to tick")
    digest = re.search(r"stdout F start ([0-9a-f]{16})$", log_of(src), re.M).group(1)  # type: ignore[union-attr]

    d = make_daemon("cri", env={"CONTAINER_RUNTIME_ENDPOINT": containerd.endpoint}).start()
    ck = json.loads(d.ctl("--json", "checkpoint", f"cri:{cid}", "--stop", "--wait", "durable", check=True).stdout)
    wait_for(lambda: not running(cri, cid), 30, what="the source container to end with its workload")
    last = max(t for t, _, _ in ticks(log_of(src)))
    d.ctl("evict", ck["id"], check=True)
    listed = json.loads(d.ctl("--json", "list", "--job", f"cri:{cid[:12]}", check=True).stdout)
    assert [(c["id"], c["container"]) for c in listed] == [(ck["id"], f"cri:{src}")]
    r = json.loads(d.ctl("--json", "restore", f"cri:{src}", "--into", f"cri:{dst}", check=True).stdout)
    assert r["checkpoint"] == ck["id"] and r["from_store"]

    goes_on(lambda: ticks(log_of(dst)), last, digest, "the restored container to compute its digest again in the "
            "placeholder pod")
    placeholder = cri.inspect(dst)
    init = placeholder.init_pid
    for kind in ("pid", "net", "ipc", "uts"):
        assert ns(r["pid"], kind) == ns(init, kind), f"restored into another {kind} namespace"
    assert sorted(in_pidns(init)) == sorted([init, r["pid"]])
    assert placeholder.hostname == "trainer-0"
    assert os.stat(f"/proc/{r['pid']}/fd/3").st_ino == os.stat(tmp_path / "log").st_ino
    assert_node_healthy(d)

    # The next generation: the placeholder pod's container is checkpointed and restored in turn.
    ck2 = json.loads(d.ctl("--json", "checkpoint", f"cri:{dst}", "--stop", check=True).stdout)
    last = max(t for t, _, _ in ticks(log_of(dst)))
    dst2 = new_pod(cri, "dst2")
    r = json.loads(d.ctl("--json", "restore", ck2["id"], "--into", f"cri:{dst2}", check=True).stdout)
    goes_on(lambda: ticks(log_of(dst2)), last, digest, "the second generation to compute its digest again")
    init = cri.inspect(dst2).init_pid
    assert sorted(in_pidns(init)) == sorted([init, r["pid"]])
    assert os.stat(f"/proc/{r['pid']}/fd/3").st_ino == os.stat(tmp_path / "log").st_ino
    assert_node_healthy(d)


def ctr(containerd: Containerd, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ctr", "--address", str(containerd.dir / "containerd.sock"), "-n", "k8s.io", *args],
                          capture_output=True, text=True, timeout=120)


def test_a_pod_s_checkpoint_goes_only_into_a_pod_and_a_failed_placeholder_leaves_nothing(
        make_daemon: Any, containerd: Containerd, cri: Any) -> None:
    # An image of its own (the test image's files, another id), gone from containerd after the checkpoint.
    doomed = f"localhost/memsnap-doomed:{secrets.token_hex(3)}"
    made = subprocess.run(["podman", "create", containerd.image], capture_output=True, text=True, check=True)
    subprocess.run(["podman", "commit", "--change", f"LABEL memsnap.test={doomed}", made.stdout.strip(), doomed],
                   capture_output=True, check=True)
    subprocess.run(["podman", "rm", made.stdout.strip()], capture_output=True)
    save = subprocess.Popen(["podman", "save", "--format", "docker-archive", doomed], stdout=subprocess.PIPE)
    imp = subprocess.run(["ctr", "--address", str(containerd.dir / "containerd.sock"), "-n", "k8s.io", "images",
                          "import", "-"], stdin=save.stdout, capture_output=True, timeout=120)
    save.wait()
    subprocess.run(["podman", "rmi", doomed], capture_output=True)
    assert imp.returncode == 0, imp.stderr

    src, dst = new_pod(cri, "src"), new_pod(cri, "dst")
    cid, _pod = cri.run_placeholder(doomed, ["/memtick", "reap", "/memtick", "--mib", "8"], "h", src, "")
    wait_for(lambda: len(ticks(log_of(src))) >= 2, 60, what="the pod's container to tick")
    d = make_daemon("cri2", env={"CONTAINER_RUNTIME_ENDPOINT": containerd.endpoint}).start()
    ck = json.loads(d.ctl("--json", "checkpoint", f"cri:{cid}", "--stop", check=True).stdout)
    r = d.ctl("restore", ck["id"], "--into", f"podman:{dst}")
    assert r.returncode != 0 and "--into cri:NAME" in r.stderr, r.stderr

    wait_for(lambda: not running(cri, cid), 30, what="the source container to end")
    with cri.Client() as c:
        image_id = c.call("ContainerStatus", c.api.ContainerStatusRequest(container_id=cid)).status.image_ref
    for ref in (doomed, image_id):
        ctr(containerd, "images", "rm", ref)
    r = d.ctl("restore", ck["id"], "--into", f"cri:{dst}")
    assert r.returncode != 0 and "FAILED_PRECONDITION" in r.stderr, r.stderr
    assert "could not start the placeholder pod" in r.stderr, r.stderr
    assert not running(cri, dst)
    assert dst not in pod_names(cri), "a failed restore left its placeholder pod"
    assert_node_healthy(d)
    assert json.loads(d.ctl("--json", "show", ck["id"], check=True).stdout)["state"] in ("staged", "durable")
