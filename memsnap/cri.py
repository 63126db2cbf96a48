"""The container runtime "cri" of memsnap.containers: a Kubernetes node's containers, through the Container Runtime
Interface (containerd's CRI plugin), without a kubelet.

A target `cri:ID` is a running container (its id, a unique id prefix, or its name in its pod); a restore `--into
cri:NAME` makes a placeholder **pod** NAME (RunPodSandbox) with one container from the checkpoint's image running
its init (CreateContainer, StartContainer): what a node agent does for Kubernetes (docs/kubernetes.md). The
runtime's socket is CONTAINER_RUNTIME_ENDPOINT (as for crictl), by default containerd's.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from typing import Any

from memsnap.errors import FailedPrecondition, NotFound

DEFAULT_ENDPOINT = "unix:///run/containerd/containerd.sock"
NAMESPACE = "memsnap"  # the Kubernetes namespace placeholder pods are made in
_TIMEOUT_S = 60.0
# On every placeholder memsnap starts, podman's or CRI's (memsnap.containers); its value: the source container's id.
PLACEHOLDER_LABEL = "memsnap.restored-from"


def endpoint() -> str:
    ep = os.environ.get("CONTAINER_RUNTIME_ENDPOINT") or DEFAULT_ENDPOINT
    return ep if "://" in ep else "unix://" + ep


class Client:
    """A RuntimeService client on endpoint() (a context manager)."""

    def __init__(self) -> None:
        import grpc

        from memsnap.criapi import cri_api_pb2 as api
        from memsnap.criapi import cri_api_pb2_grpc as api_grpc

        self.api, self._grpc = api, grpc
        self._channel = grpc.insecure_channel(endpoint())
        self.rt = api_grpc.RuntimeServiceStub(self._channel)  # type: ignore[no-untyped-call]

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self._channel.close()

    def call(self, method: str, req: Any) -> Any:
        try:
            return getattr(self.rt, method)(req, timeout=_TIMEOUT_S)
        except self._grpc.RpcError as exc:
            code = exc.code()
            if code == self._grpc.StatusCode.NOT_FOUND:
                raise NotFound(f"the container runtime ({endpoint()}) says: {exc.details()}") from exc
            raise FailedPrecondition(f"the container runtime ({endpoint()}) refused {method}: "
                                     f"{code.name}: {(exc.details() or '')[:200]}") from exc

    def find(self, name: str) -> str:
        """The id of the running container `name` names: its id, a unique prefix of it, or its name."""
        api = self.api
        running = api.ContainerFilter(state=api.ContainerStateValue(state=api.CONTAINER_RUNNING))
        got = self.call("ListContainers", api.ListContainersRequest(filter=running)).containers
        hits = [c.id for c in got if c.id == name or c.metadata.name == name] or \
            [c.id for c in got if c.id.startswith(name)]
        if len(hits) != 1:
            raise NotFound(f"no running CRI container {name!r} on this node" if not hits else
                           f"{len(hits)} CRI containers match {name!r}: name one by its id")
        return str(hits[0])


@dataclass
class Found:
    """A running CRI container, as memsnap.containers needs it."""

    id: str
    name: str
    image: str
    init_pid: int
    hostname: str
    pod: str  # its pod sandbox's id
    labels: dict[str, str]
    mounts: list[tuple[str, str, bool]]  # (container path, host path, read-only) of the mounts it was created with


def inspect(name: str) -> Found:
    """The running container `name` (NotFound / FailedPrecondition as memsnap.containers.inspect)."""
    with Client() as c:
        cid = c.find(name)
        r = c.call("ContainerStatus", c.api.ContainerStatusRequest(container_id=cid, verbose=True))
    try:
        info = json.loads(r.info.get("info", "{}"))
        pid = int(info.get("pid") or 0)
    except (ValueError, TypeError) as exc:
        raise FailedPrecondition(f"the container runtime reported container {name!r} in a shape memsnap does not "
                                 "know") from exc
    if r.status.state != c.api.CONTAINER_RUNNING or pid <= 0:
        raise FailedPrecondition(f"CRI container {name!r} is not running")
    try:  # (the pod's hostname file, which the runtime binds into every container of the pod)
        with open(f"/proc/{pid}/root/etc/hostname", encoding="ascii", errors="replace") as f:
            hostname = f.read().strip()
    except OSError:
        hostname = ""
    return Found(id=r.status.id, name=r.status.metadata.name, image=r.status.image_ref or r.status.image.image,
                 init_pid=pid, hostname=hostname, pod=str(info.get("sandboxID") or ""),
                 labels=dict(r.status.labels),
                 mounts=[(m.container_path, m.host_path, m.readonly) for m in r.status.mounts])


def run_placeholder(image: str, init_argv: list[str], hostname: str, name: str, restored_from: str,
                    mounts: list[tuple[str, str, bool]] | None = None) -> tuple[str, str]:
    """Starts the placeholder pod `name`: one container of image running init_argv, in a PID namespace of its own
    (as the checkpointed container had), with that hostname and these mounts (container path, host path,
    read-only); (its container's id, the pod's). Pod and container are labelled PLACEHOLDER_LABEL=restored_from
    (the checkpoint's container id; "": no label, a plain pod)."""
    try:
        return _run_placeholder(image, init_argv, hostname, name, restored_from, mounts or [])
    except (NotFound, FailedPrecondition) as exc:
        raise FailedPrecondition(f"could not start the placeholder pod {name!r} from image {image[:19]}: "
                                 f"{exc}") from exc


def _run_placeholder(image: str, init_argv: list[str], hostname: str, name: str, restored_from: str,
                     mounts: list[tuple[str, str, bool]]) -> tuple[str, str]:
    labels = {PLACEHOLDER_LABEL: restored_from[:63]} if restored_from else {}
    with Client() as c:
        api = c.api
        ns = api.NamespaceOption(network=api.POD, pid=api.CONTAINER, ipc=api.POD)
        sandbox = api.PodSandboxConfig(
            metadata=api.PodSandboxMetadata(name=name, namespace=NAMESPACE, uid=secrets.token_hex(8)),
            hostname=hostname, log_directory=f"/var/log/memsnap-pods/{name}",
            labels=labels,
            linux=api.LinuxPodSandboxConfig(security_context=api.LinuxSandboxSecurityContext(namespace_options=ns)))
        pod = c.call("RunPodSandbox", api.RunPodSandboxRequest(config=sandbox)).pod_sandbox_id
        try:
            cfg = api.ContainerConfig(
                metadata=api.ContainerMetadata(name=name), image=api.ImageSpec(image=image),
                command=list(init_argv), log_path=f"{name}.log", labels=labels,
                mounts=[api.Mount(container_path=path, host_path=host, readonly=ro) for path, host, ro in mounts],
                linux=api.LinuxContainerConfig(security_context=api.LinuxContainerSecurityContext(
                    namespace_options=ns)))
            cid = c.call("CreateContainer", api.CreateContainerRequest(pod_sandbox_id=pod, config=cfg,
                                                                        sandbox_config=sandbox)).container_id
            c.call("StartContainer", api.StartContainerRequest(container_id=cid))
        except Exception:
            remove(pod)
            raise
    return str(cid), str(pod)


def find_placeholder_pod(name: str) -> str:
    """The id of the pod memsnap made as placeholder `name` (namespace NAMESPACE, PLACEHOLDER_LABEL), or ""."""
    with Client() as c:
        for pod in c.call("ListPodSandbox", c.api.ListPodSandboxRequest()).items:
            if pod.metadata.name == name and pod.metadata.namespace == NAMESPACE and PLACEHOLDER_LABEL in pod.labels:
                return str(pod.id)
    return ""


def remove(pod: str) -> None:
    """Stops and removes the placeholder pod (a restore into it failed); never raises."""
    import logging

    try:
        with Client() as c:
            c.call("StopPodSandbox", c.api.StopPodSandboxRequest(pod_sandbox_id=pod))
            c.call("RemovePodSandbox", c.api.RemovePodSandboxRequest(pod_sandbox_id=pod))
    except Exception as exc:  # (a failed restore's cleanup: its own error is the one to report)
        logging.getLogger("memsnap.containers").warning("could not remove placeholder pod %s: %s", pod, exc)
