"""Containers moved between two nodes (issue 33): each node a network namespace of its own, with its own container
runtime (podman with its own storage, or a containerd of its own) and its own memsnapd, joined by a bridge (the
image crosses that link). The moved container goes on in a placeholder that the target's runtime started, on the
target's container network: a server in it answers at the placeholder's address, on the target only.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pyroute2 import netns

from tests.e2e.test_containers import (  # noqa: F401 (image: a fixture)
    goes_on,
    image,
    in_pidns,
    ns,
    start_digest,
    ticks,
)
from tests.e2e.test_containers_cri import PODS, SCRIPT, log_of, pod_names
from tests.e2e.test_containers_cri import ticks as cri_ticks
from tests.helpers import assert_node_healthy, wait_for
from tests.netlab import NsDaemon, bridge, node_args

SUBNET = "10.213.79"
MIB = 256
# The container's workload: 256 MiB of memory with its digest, and a web server (its child) serving /etc. (The shell
# execs: "--" tells the init's arguments from the command's.)
WORKLOAD = ["/memtick", "reap", "--", "/bin/sh", "-c", "/bin/busybox httpd -f -p 8080 -h /etc & exec /memtick --mib "
            f"{MIB} --interval-ms 100 --digest-every 10"]


@dataclass
class Node:
    """Node n of the LAN: its network namespace, its directory, its runtime's environment, its memsnapd."""

    n: int
    netns: str
    dir: Path
    env: dict[str, str] = field(default_factory=dict)
    daemon: NsDaemon | None = None

    @property
    def address(self) -> str:
        return f"{SUBNET}.{self.n}:7443"

    def run(self, *argv: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """argv in this node's network namespace and runtime environment."""
        r = subprocess.run(["nsenter", f"--net=/run/netns/{self.netns}", *argv], capture_output=True, text=True,
                           timeout=timeout, env={**os.environ, **self.env})
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} on node {self.n}: {r.stderr.strip()}")
        return r

    def podman(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run("podman", *args, check=check)

    def get(self, ip: str, path: str) -> str:
        """GET http://ip:8080/path from this node ('' if nothing answers)."""
        code = ("import sys, urllib.request\n"
                "with urllib.request.urlopen(sys.argv[1], timeout=3) as r: print(r.read().decode().strip())")
        r = self.run(sys.executable, "-c", code, f"http://{ip}:8080{path}", check=False)
        return r.stdout.strip() if r.returncode == 0 else ""

    def start_daemon(self, token: Path) -> NsDaemon:
        self.daemon = NsDaemon(self.dir / "memsnapd", netns=self.netns, extra=node_args(SUBNET, self.n, token),
                               env=self.env).start()
        return self.daemon


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[tuple[Node, Node]]:
    """Nodes 1 and 2 on one bridge, each with its memsnapd (started by the test, once its runtime is set up)."""
    tag = secrets.token_hex(3)
    sw, a, b = f"ms-sw-{tag}", Node(1, f"ms-n1-{tag}", tmp_path / "n1"), Node(2, f"ms-n2-{tag}", tmp_path / "n2")
    bridge(sw, [(a.netns, f"{SUBNET}.1"), (b.netns, f"{SUBNET}.2")])
    a.dir.mkdir()
    b.dir.mkdir()
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(32))
    try:
        yield a, b
    finally:
        for node in (a, b):
            if node.daemon is not None:
                node.daemon.cleanup()
        for name in (a.netns, b.netns, sw):
            try:
                netns.remove(name)
            except OSError:
                pass


def podman_node(node: Node, image_name: str) -> None:
    """Gives the node a podman of its own: its own storage, run and temporary directories and network
    configuration (CONTAINERS_CONF replaces the system's containers.conf: setup-podman.sh's settings are repeated),
    with the test image loaded from the host's storage."""
    d = node.dir
    (d / "containers.conf").write_text(
        '[containers]\ndefault_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]\n'
        f'[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\ntmp_dir = "{d}/libpod"\n'
        f'[network]\nnetwork_config_dir = "{d}/cni"\n')
    (d / "storage.conf").write_text(f'[storage]\ndriver = "overlay"\ngraphroot = "{d}/graph"\n'
                                    f'runroot = "{d}/run"\n')
    node.env = {"CONTAINERS_CONF": str(d / "containers.conf"), "CONTAINERS_STORAGE_CONF": str(d / "storage.conf")}
    subprocess.run(["podman", "save", "--format", "oci-archive", "-o", str(d / "image.tar"), image_name],
                   check=True,
                   capture_output=True, timeout=120)
    node.podman("load", "-i", str(d / "image.tar"))


def podman_logs(node: Node, name: str) -> str:
    r = node.podman("logs", name, check=False)
    return r.stdout + r.stderr


def test_a_container_moved_to_another_node_goes_on_in_that_node_s_podman_and_answers_on_its_network(
        nodes: tuple[Node, Node], image: str, tmp_path: Path) -> None:  # noqa: F811
    a, b = nodes
    for node in nodes:
        podman_node(node, image)
        node.start_daemon(tmp_path / "token")
    assert a.daemon is not None and b.daemon is not None
    src, dst = f"ms-src-{secrets.token_hex(3)}", f"ms-dst-{secrets.token_hex(3)}"
    try:
        a.podman("run", "-d", "--name", src, "--network", "bridge", "--hostname", src, image, *WORKLOAD)
        wait_for(lambda: len(ticks(podman_logs(a, src))) >= 3, 60, what="the container's workload to tick")
        digest = start_digest(podman_logs(a, src))
        old_ip = a.podman("container", "inspect", "--format", "{{.NetworkSettings.IPAddress}}", src).stdout.strip()
        wait_for(lambda: a.get(old_ip, "/hostname") == src, 30, what="the server to answer on node 1")

        r = a.daemon.ctl("--json", "migrate", f"podman:{src}", "--to", b.address, "--into", f"podman:{dst}",
                         timeout=300)
        assert r.returncode == 0, r.stderr + a.daemon.log.read_text()[-2000:] + b.daemon.log.read_text()[-2000:]
        out = json.loads(r.stdout)

        # Its memory and its log go on in node 2's podman.
        last = max(t for t, _, _ in ticks(podman_logs(a, src)))
        goes_on(lambda: ticks(podman_logs(b, dst)), last, digest, "the moved workload to compute its digest again "
                "in node 2's placeholder")
        init = int(b.podman("container", "inspect", "--format", "{{.State.Pid}}", dst).stdout)
        assert ns(out["target_pid"], "net") == ns(init, "net")
        wait_for(lambda: len(in_pidns(init)) == 3, 10, what="the placeholder to hold its init, the workload and its "
                 "server only")

        # Its server answers at the placeholder's address on node 2's container network, with its hostname, and
        # sees the placeholder's /etc/hosts; node 1 cannot reach it there.
        new_ip = b.podman("container", "inspect", "--format", "{{.NetworkSettings.IPAddress}}", dst).stdout.strip()
        wait_for(lambda: b.get(new_ip, "/hostname") == src, 30, what="the moved server to answer on node 2")
        assert new_ip in b.get(new_ip, "/hosts")
        assert a.get(new_ip, "/hostname") == ""

        # Each runtime knows its own containers only; the source ended with its workload; nothing left over.
        wait_for(lambda: a.podman("container", "inspect", "--format", "{{.State.Running}}", src).stdout.strip()
                 == "false", 30, what="the source container to end")
        assert a.podman("container", "exists", dst, check=False).returncode == 1
        assert b.podman("container", "exists", src, check=False).returncode == 1
        assert_node_healthy(a.daemon, restorable=set())
        assert_node_healthy(b.daemon)
    finally:
        a.podman("rm", "-f", "-t", "0", src, check=False)
        b.podman("rm", "-f", "-t", "0", dst, check=False)


@contextmanager
def runtime_of(node: Node) -> Iterator[Any]:
    """memsnap.cri on node's containerd."""
    from memsnap import cri

    old = os.environ.get("CONTAINER_RUNTIME_ENDPOINT")
    os.environ["CONTAINER_RUNTIME_ENDPOINT"] = node.env["CONTAINER_RUNTIME_ENDPOINT"]
    try:
        yield cri
    finally:
        if old is None:
            del os.environ["CONTAINER_RUNTIME_ENDPOINT"]
        else:
            os.environ["CONTAINER_RUNTIME_ENDPOINT"] = old


def pod_ip(pid: int) -> str:
    r = subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", "ip", "-4", "-o", "addr", "show", "eth0"],
                       capture_output=True, text=True, check=True)
    return r.stdout.split()[3].split("/")[0]


def test_a_pod_s_container_moved_to_another_node_goes_on_in_a_pod_of_that_node_s_containerd(
        nodes: tuple[Node, Node], tmp_path: Path) -> None:
    a, b = nodes
    started: list[Node] = []
    src, dst = f"ms-src-{secrets.token_hex(3)}", f"ms-dst-{secrets.token_hex(3)}"
    try:
        for node in nodes:
            r = node.run(str(SCRIPT), "start", str(node.dir / "containerd"), timeout=300)
            started.append(node)
            node.env = {"CONTAINER_RUNTIME_ENDPOINT": f"unix://{node.dir / 'containerd' / 'containerd.sock'}"}
            node.start_daemon(tmp_path / "token")
        image = r.stdout.split()[-1]
        assert a.daemon is not None and b.daemon is not None
        with runtime_of(a) as cri:
            cid, _pod = cri.run_placeholder(image, WORKLOAD, "worker-1", src, "")  # (a plain pod)
            old_ip = pod_ip(cri.inspect(cid).init_pid)
        wait_for(lambda: len(cri_ticks(log_of(src))) >= 3, 60, what="the pod's container to tick")
        digest = start_digest("\n".join(line.split(" F ", 1)[-1] for line in log_of(src).splitlines()))
        wait_for(lambda: a.get(old_ip, "/hostname") == "worker-1", 30, what="the server to answer on node 1")

        r = a.daemon.ctl("--json", "migrate", f"cri:{cid}", "--to", b.address, "--into", f"cri:{dst}", timeout=300)
        assert r.returncode == 0, r.stderr + a.daemon.log.read_text()[-2000:] + b.daemon.log.read_text()[-2000:]
        out = json.loads(r.stdout)

        last = max(t for t, _, _ in cri_ticks(log_of(src)))
        goes_on(lambda: cri_ticks(log_of(dst)), last, digest, "the moved container to compute its digest again in "
                "node 2's placeholder pod")
        with runtime_of(b) as cri:
            init = cri.inspect(dst).init_pid
            assert dst in pod_names(cri) and src not in pod_names(cri)
        assert ns(out["target_pid"], "net") == ns(init, "net")
        wait_for(lambda: len(in_pidns(init)) == 3, 10, what="the placeholder pod to hold its init and the workload")
        new_ip = pod_ip(init)
        wait_for(lambda: b.get(new_ip, "/hostname") == "worker-1", 30, what="the moved server to answer on node 2")
        with runtime_of(a) as cri:
            wait_for(lambda: src not in [c.metadata.name for c in _running(cri)], 30,
                     what="the source container to end")
            assert dst not in pod_names(cri)
        assert_node_healthy(a.daemon, restorable=set())
        assert_node_healthy(b.daemon)
    finally:
        for node in started:
            if node.daemon is not None:
                node.daemon.cleanup()
                node.daemon = None
            with runtime_of(node) as cri, cri.Client() as c:  # (a pod's network namespace goes with the pod)
                for pod in c.call("ListPodSandbox", c.api.ListPodSandboxRequest()).items:
                    cri.remove(pod.id)
            node.run(str(SCRIPT), "stop", str(node.dir / "containerd"), check=False, timeout=120)
        for name in (src, dst):
            shutil.rmtree(PODS / name, ignore_errors=True)


def _running(cri: Any) -> list[Any]:
    with cri.Client() as c:
        api = c.api
        running = api.ContainerFilter(state=api.ContainerStateValue(state=api.CONTAINER_RUNNING))
        return list(c.call("ListContainers", api.ListContainersRequest(filter=running)).containers)
