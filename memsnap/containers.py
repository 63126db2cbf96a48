"""Containers as jobs (issue 33): a container's process tree dumped from the host, restored into a placeholder.

memsnap asks the container runtime (podman, or any CRI runtime: memsnap.cri) only for facts (the init's pid, the
rootfs, the image) and for a placeholder container (a placeholder pod, through CRI); the dump and the restore are
memsnap's own CRIU calls, so the tier, the drain, the chunk store, lazy restores and moves apply to containers as
to any job. This is the pattern of NVIDIA Dynamo Snapshot, and of runc's own `checkpoint`/`restore`,
without the runtime's image tarball:

- The container runs its workload under an init that reaps (its PID 1: `podman run --init`, tini, or the test
  image's `memtick reap`). memsnap dumps the init's one child and its tree, never the init: the placeholder's
  own init takes its place, so the restored tree keeps its pids in the placeholder's PID namespace. The
  placeholder runs the init alone (init_alone()): never a second copy of the workload.
- Dump: the container's rootfs is CRIU's root; its network and PID namespaces are external (keys extNetNs,
  extPidNs); every mount that shares its filesystem with the host (a bind mount: /etc/hosts, /dev/shm, the cgroup
  mounts) is external under its container path, so a restore can bind the placeholder's own there; its
  cgroups are the runtime's (CRIU ignores them).
- Restore: memsnap starts the placeholder from the same image with the same init and no workload, then CRIU
  restores the tree into it: the placeholder's rootfs as root, its PID and network namespaces inherited, its IPC
  and UTS namespaces joined, CRIU started inside its cgroups, each external mount bound from the placeholder's
  mount at that path, and the tree's stdout/stderr pipes replaced by the placeholder init's (so `podman logs`
  of the placeholder shows the restored tree's output).

The container's facts travel in the signed manifest (extra["container"]); a restore trusts them only as far
as they select among the placeholder's own namespaces, mounts and fds.

Who may act: the tree must be the caller's to checkpoint (Checkpointer's usual check on the workload's uid:
root for a rootful container), and only root may restore a container, because the placeholder is a new
container. The placeholder is always one memsnap creates under a name nobody uses yet, never an existing container
a caller names, so a restore can never enter another tenant's namespaces.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from memsnap import proc
from memsnap.cri import PLACEHOLDER_LABEL
from memsnap.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from memsnap.mounts import Mount, mountinfo

if TYPE_CHECKING:
    from memsnap.catalog import Catalog

log = logging.getLogger("memsnap.containers")

RUNTIMES = ("podman", "cri")  # cri: a Kubernetes node's containers, through CRI (memsnap.cri)
NET_KEY, PID_KEY = "extNetNs", "extPidNs"
# podman's own rule for names (and a 64-hex id is one too).
_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]{0,127}")
_PIPE = re.compile(r"pipe:\[\d{1,20}\]")
_HOSTNAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,62}")
_PODMAN_TIMEOUT_S = 60.0


def authorize(is_root: bool) -> None:
    """Containers are root's (rootful podman): anyone else is refused before the runtime is even asked (which
    would tell them which containers exist)."""
    if not is_root:
        raise PermissionDenied("only root may checkpoint or move containers (rootful podman, or a CRI runtime's)")


def of_checkpoint(meta: dict[str, Any]) -> str:
    """RUNTIME:NAME of the container a checkpoint (its catalog meta) was taken of, or ""."""
    c = meta.get("container")
    return f"{c.get('runtime', '')}:{c.get('name', '')}" if isinstance(c, dict) else ""


def is_of(meta: dict[str, Any], target: str) -> bool:
    """Whether a checkpoint (its catalog meta) was taken of the container `target` names: RUNTIME:NAME with the
    container's name, its id, or (12 characters or more) a prefix of its id."""
    got, c = parse_target(target), meta.get("container")
    if got is None or not isinstance(c, dict) or c.get("runtime") != got[0]:
        return False
    name, cid = str(c.get("name", "")), str(c.get("id", ""))
    return got[1] in (name, cid) or (len(got[1]) >= 12 and cid.startswith(got[1]))


def parse_target(target: str) -> tuple[str, str] | None:
    """(RUNTIME, NAME) for a target "podman:NAME" or "cri:NAME"; None for any other target (a pid, a job)."""
    runtime, sep, name = target.partition(":")
    if not sep or runtime not in RUNTIMES:
        return None
    if not _NAME.fullmatch(name):
        raise InvalidArgument(f"{target[:80]!r} names no container: use {runtime}:NAME with the container's "
                              "name or id (letters, digits, '_', '.', '-')")
    return runtime, name


@dataclass
class ContainerFacts:
    """What a restore needs to know of the container a tree was dumped from (signed into its manifest)."""

    runtime: str
    id: str
    name: str
    image: str  # the image's id: the placeholder starts from the very same image
    init_argv: list[str]  # the container's PID 1 without the workload's own argv: the placeholder's command
    network: str  # the runtime's network mode ("none", "bridge", ...): the placeholder gets the same kind
    mounts: list[str] = field(default_factory=list)  # container paths of the mounts made external
    stdio: dict[str, str] = field(default_factory=dict)  # "1"/"2" -> CRIU's key for that pipe ("pipe:[ino]")
    pid_in_container: int = 0
    hostname: str = ""  # the container's own: the placeholder gets it too (a program may have cached it)
    # its volumes, which the placeholder mounts again (their data is not in the image: see volume_args()):
    # {"kind": "volume" (a named volume of the runtime) or "bind" (a host path), "source", "destination", "rw"}
    volumes: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"runtime": self.runtime, "id": self.id, "name": self.name, "image": self.image,
                "init_argv": list(self.init_argv), "network": self.network, "mounts": list(self.mounts),
                "stdio": dict(self.stdio), "pid_in_container": self.pid_in_container, "hostname": self.hostname,
                **({"volumes": [dict(v) for v in self.volumes]} if self.volumes else {})}

    @classmethod
    def from_manifest(cls, d: object) -> ContainerFacts:
        """The facts of a verified manifest, checked for the shapes memsnap writes (FailedPrecondition if not)."""
        bad = FailedPrecondition("the checkpoint's container facts are malformed; restore it with the memsnap "
                                 "version that made it")
        if not isinstance(d, dict):
            raise bad
        try:
            f = cls(runtime=d["runtime"], id=d["id"], name=d["name"], image=d["image"],
                    init_argv=list(d["init_argv"]), network=d["network"], mounts=list(d["mounts"]),
                    stdio=dict(d["stdio"]), pid_in_container=int(d.get("pid_in_container", 0)),
                    hostname=d.get("hostname", ""), volumes=list(d.get("volumes", [])))
        except (KeyError, TypeError, ValueError) as exc:
            raise bad from exc
        strs = [f.runtime, f.id, f.name, f.image, f.network, f.hostname, *f.init_argv, *f.mounts]
        if f.runtime not in RUNTIMES or not all(isinstance(s, str) for s in strs) or not f.init_argv \
                or not all(_container_path(m) for m in f.mounts) or not _HOSTNAME.fullmatch(f.hostname or "h") \
                or not all(k in ("0", "1", "2") and isinstance(v, str) and _PIPE.fullmatch(v)
                           for k, v in f.stdio.items()) or not all(_volume_ok(v) for v in f.volumes):
            raise bad
        return f


def _volume_ok(v: object) -> bool:
    """A volume entry in the shape memsnap writes: a named volume's name or an absolute host path (neither with
    the ':' or ',' a runtime's mount syntax splits on), mounted at a container path."""
    if not isinstance(v, dict) or set(v) != {"kind", "source", "destination", "rw"} or not isinstance(v["rw"], bool):
        return False
    src, dst = v["source"], v["destination"]
    if not _container_path(dst) or any(c in dst for c in ":,"):
        return False
    if v["kind"] == "volume":
        return isinstance(src, str) and bool(_NAME.fullmatch(src))
    return v["kind"] == "bind" and _container_path(src) and not any(c in src for c in ":,")


@dataclass
class Running:
    """A running container as its runtime reports it."""

    id: str
    name: str
    image: str
    init_pid: int
    rootfs: str
    network: str
    hostname: str = ""
    handle: str = ""  # what removes it: podman's container name, CRI's pod sandbox id
    placeholder: bool = False  # one memsnap started (label PLACEHOLDER_LABEL): its init runs alone, as started
    volumes: list[dict[str, Any]] = field(default_factory=list)  # as ContainerFacts.volumes



# -- the runtime (podman's CLI; containerd's CRI would be a second implementation) -------------------------------

def podman_binary() -> str:
    path = shutil.which("podman")
    if not path:
        raise FailedPrecondition("podman is not installed on this node (scripts/containers/setup-podman.sh)")
    return path


def _podman(*args: str, timeout: float = _PODMAN_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run([podman_binary(), *args], capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise FailedPrecondition(f"podman {args[0]} did not answer within {timeout:.0f} s") from exc


def inspect(runtime: str, name: str) -> Running:
    """The running container NAME (NotFound if none, FailedPrecondition if it is not running)."""
    if runtime == "cri":
        from memsnap import cri

        f = cri.inspect(name)
        return Running(id=f.id, name=f.name, image=f.image, init_pid=f.init_pid, rootfs=rootfs_of(f.init_pid),
                       network="pod", hostname=f.hostname, handle=f.pod, placeholder=PLACEHOLDER_LABEL in f.labels,
                       volumes=[{"kind": "bind", "source": host, "destination": path, "rw": not ro}
                                for path, host, ro in f.mounts])
    r = _podman("container", "inspect", "--format", "json", name)
    if r.returncode != 0:
        raise NotFound(f"no {runtime} container {name!r} on this node ('podman ps -a' lists them)")
    try:
        d = json.loads(r.stdout)[0]
        state = d["State"]
        if not state.get("Running") or int(state.get("Pid") or 0) <= 0:
            raise FailedPrecondition(f"{runtime} container {name!r} is not running")
        return Running(id=d["Id"], name=d["Name"], image=d["Image"], init_pid=int(state["Pid"]),
                       rootfs=d["GraphDriver"]["Data"]["MergedDir"],
                       network=str(d.get("HostConfig", {}).get("NetworkMode") or "bridge"),
                       hostname=str(d.get("Config", {}).get("Hostname") or ""), handle=name,
                       placeholder=PLACEHOLDER_LABEL in (d.get("Config", {}).get("Labels") or {}),
                       volumes=[{"kind": m["Type"], "source": m["Name"] if m["Type"] == "volume" else m["Source"],
                                 "destination": m["Destination"], "rw": bool(m.get("RW"))}
                                for m in d.get("Mounts") or [] if m.get("Type") in ("volume", "bind")])
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise FailedPrecondition(f"podman reported container {name!r} in a shape memsnap does not know") from exc


def volume_args(facts: ContainerFacts, binds_allowed: bool) -> list[str]:
    """podman's -v arguments that mount the container's volumes in its placeholder: the same named volumes and host
    paths, which must be on this node (memsnap does not carry their data: a volume that is missing here is
    refused, never created empty). binds_allowed: False for an image a peer sent (a move), whose bind mounts
    would let it choose host paths on this node. (A CRI container's mounts are all host paths: the same checks,
    then its placeholder's ContainerConfig.mounts.)"""
    out = []
    for v in facts.volumes:
        src, dst, mode = v["source"], v["destination"], "rw" if v["rw"] else "ro"
        if v["kind"] == "bind":
            if not binds_allowed:
                raise FailedPrecondition(f"the container mounts host path {src} at {dst}: a container with bind "
                                         "mounts is not restored from another node's image (use a named volume)")
            if not os.path.exists(src):
                raise FailedPrecondition(f"host path {src} (mounted at {dst}) is not on this node: memsnap does not "
                                         "carry a bind mount's data")
        elif _podman("volume", "exists", src).returncode != 0:
            raise FailedPrecondition(f"volume {src!r} (mounted at {dst}) is not on this node: memsnap does not carry a "
                                     "volume's data; create it here, with its data, and restore again")
        out += ["-v", f"{src}:{dst}:{mode}"]
    return out


def run_placeholder(facts: ContainerFacts, name: str, binds_allowed: bool = True) -> Running:
    """Starts the placeholder NAME: the image of facts, its init with no workload, the same kind of network, the
    same volumes (volume_args)."""
    if facts.runtime == "cri":
        from memsnap import cri

        volume_args(facts, binds_allowed)  # (the checks; CRI takes the mounts themselves)
        cid, pod = cri.run_placeholder(facts.image, facts.init_argv, facts.hostname, name, facts.id,
                                       [(v["destination"], v["source"], not v["rw"]) for v in facts.volumes])
        try:
            running = inspect("cri", cid)
        except Exception:
            remove("cri", pod)
            raise
        running.name = name
        return running
    network = facts.network if facts.network in ("none", "bridge", "slirp4netns", "host") else "bridge"
    if network == "host":
        raise FailedPrecondition("a container on the host's network cannot be restored into a placeholder")
    hostname = ["--hostname", facts.hostname] if facts.hostname else []
    volumes = volume_args(facts, binds_allowed)
    # --pull never: the image is the checkpoint's, by id; a node without it says so at once (a pull by id would
    # only retry a registry for seconds, and could never give the same image).
    r = _podman("run", "-d", "--pull", "never", "--name", name, "--network", network,
                "--label", f"{PLACEHOLDER_LABEL}={facts.id}", *hostname, *volumes, facts.image, *facts.init_argv)
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or ["podman run failed"])[-1]
        if "already in use" in why:
            raise FailedPrecondition(f"a container named {name!r} exists already: restore into a new name")
        if "image not known" in why:
            raise FailedPrecondition(f"could not start the placeholder {name!r}: image {facts.image[:19]} is not on "
                                     "this node (podman load or pull it here, then restore again)")
        raise FailedPrecondition(f"could not start the placeholder {name!r} from image {facts.image[:19]}: "
                                 f"{why[:200]}")
    try:
        return inspect(facts.runtime, name)
    except Exception:
        remove(facts.runtime, name)
        raise


def drop_journaled(catalog: Catalog, ckpt_id: str) -> None:
    """Removes the placeholder journaled in a checkpoint's meta ("placeholder": a restore that never recorded
    its job, or a move's restore the source never committed) and clears the entry; nothing when there is none."""
    from memsnap import lifecycle

    rec = catalog.get_checkpoint(ckpt_id)
    entry = rec.meta.get("placeholder") if rec is not None else None
    if isinstance(entry, dict):
        log.warning("%s: %s", ckpt_id, remove_placeholder(entry))
        lifecycle.mark(catalog, ckpt_id, placeholder=None)


def remove_placeholder(entry: dict[str, Any]) -> str:
    """Removes the placeholder a restore journaled (Restorer._place) and never finished with: by its handle, or,
    when the daemon died while starting it, by its name (a CRI pod of that name that memsnap made). What was
    done, for the log; never raises."""
    runtime, name, handle = (str(entry.get(k, "")) for k in ("runtime", "name", "handle"))
    if runtime == "cri" and not handle and name:
        from memsnap import cri

        try:
            handle = cri.find_placeholder_pod(name)
        except Exception as exc:  # (recovery goes on: the pod stays, and says so)
            return f"could not look for placeholder pod {name!r}: {exc}"
    handle = handle or (name if runtime == "podman" else "")
    if runtime not in RUNTIMES or not handle:
        return f"no placeholder to remove for {entry!r}"
    remove(runtime, handle)
    return f"removed placeholder {runtime}:{name}"


def remove(runtime: str, handle: str) -> None:
    """Removes a placeholder memsnap made (a restore into it failed; handle: Running.handle); logs, never raises."""
    if runtime == "cri":
        from memsnap import cri

        cri.remove(handle)
        return
    name = handle
    try:
        r = _podman("rm", "-f", "-t", "0", name)
        if r.returncode != 0:
            log.warning("could not remove placeholder %s: %s", name, r.stderr.strip()[:200])
    except Exception as exc:  # (a failed restore's cleanup: its own error is the one to report)
        log.warning("could not remove placeholder %s: %s", name, exc)


# -- facts of the host's processes and mounts --------------------------------------------------------------------

def _container_path(p: object) -> bool:
    return isinstance(p, str) and p.startswith("/") and p != "/" and len(p) < 4096 \
        and ".." not in p.split("/") and "\x00" not in p and "[" not in p and "]" not in p


def external_mounts(pid: int) -> list[str]:
    """The container paths of pid's mounts whose filesystem is also mounted on the host (bind mounts of the host's
    files and of its cgroup and shm mounts): CRIU cannot dump them, a restore binds the placeholder's there. The
    rootfs itself is CRIU's root, not a mount of its own."""
    host_devs = {m.dev for m in mountinfo("self")}
    return [m.point for m in mountinfo(pid) if m.point != "/" and m.dev in host_devs and _container_path(m.point)]


def host_path_of(pid: int, point: str) -> str:
    """Where, in memsnapd's mount namespace, the filesystem pid sees mounted at point can be bound from (the host
    mount of the same filesystem whose root holds it), or FailedPrecondition."""
    theirs = [m for m in mountinfo(pid) if m.point == point]
    if not theirs:
        raise FailedPrecondition(f"the placeholder has no mount at {point}, which the checkpointed container had")
    m = theirs[-1]  # (the top one, where several are stacked)
    best = None
    for h in mountinfo("self"):
        if h.dev != m.dev:
            continue
        rel = os.path.relpath(m.root, h.root) if h.root != "/" else m.root.lstrip("/")
        if rel == ".." or rel.startswith("../"):
            continue
        if best is None or len(h.root) > len(best[0].root):
            best = (h, rel)
    if best is None:
        raise FailedPrecondition(f"the placeholder's mount at {point} is not reachable from the host")
    h, rel = best
    return os.path.normpath(os.path.join(h.point, rel)) if rel not in ("", ".") else h.point


def rootfs_of(pid: int) -> str:
    """Where, in memsnapd's mount namespace, pid's root filesystem is mounted (a container's rootfs)."""
    root = next((m for m in reversed(mountinfo(pid)) if m.point == "/"), None)
    if root is None:
        raise FailedPrecondition(f"pid {pid} has no root mount")
    for h in mountinfo("self"):
        if h.dev == root.dev and h.root == root.root and h.point != "/":
            return h.point
    raise FailedPrecondition(f"the root filesystem of pid {pid} is not mounted where memsnapd can reach it")


def cgroup_procs_files(pid: int) -> list[str]:
    """The cgroup.procs file of each of pid's cgroups (v1 hierarchies and the v2 one), as mounted on the host."""
    with open(f"/proc/{pid}/cgroup", encoding="utf-8") as f:
        return procs_files(f.read(), mountinfo("self"))


def procs_files(cgroups: str, host: list[Mount]) -> list[str]:
    """cgroup_procs_files() of a /proc/PID/cgroup text, against the host's mounts."""
    hier = [m for m in host if m.fstype in ("cgroup", "cgroup2")]
    out = []
    for line in cgroups.splitlines():
        _hid, ctrls, path = line.split(":", 2)
        want = set(ctrls.split(",")) if ctrls else set()
        for m in hier:
            opts = {f"{k}={v}" if v else k for k, v in m.options}  # ("name=systemd" names a hierarchy)
            if (m.fstype == "cgroup2") == (not want) and (not want or want <= opts):
                rel = os.path.relpath(path, m.root)
                if rel == ".." or rel.startswith("../"):
                    continue
                procs = os.path.normpath(os.path.join(m.point, rel, "cgroup.procs"))
                if os.path.exists(procs):
                    out.append(procs)
                break
    return out


def _cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode(errors="surrogateescape") for a in f.read().split(b"\0")[:-1]]


# -- what the Checkpointer and the Restorer ask ----------------------------------------------------------------

@dataclass
class DumpPlan:
    pid: int  # the workload: the root of the dumped tree
    facts: ContainerFacts
    dump_opts: dict[str, Any]


def plan_for(target: str, is_root: bool) -> DumpPlan | None:
    """The dump plan of the container a checkpoint or move target names (RUNTIME:NAME), after the caller was
    authorized; None for any other target (a pid, a job)."""
    named = parse_target(target)
    if named is None:
        return None
    authorize(is_root)
    return plan_dump(*named)


def init_alone(init_argv: list[str], argv: list[str]) -> list[str] | None:
    """The argv that starts the init alone (the placeholder's), from the init's argv and its workload's (an init
    runs "init [OPTIONS] [--] CMD ARGS"); None when that cannot be told: a placeholder that started a second copy
    of the workload would be worse than no restore.
    - the workload's argv ends the init's: the rest, without a trailing "--";
    - else (the workload exec'd another program) a "--" in the init's argv: what comes before it."""
    if argv and len(init_argv) > len(argv) and init_argv[-len(argv):] == argv:
        alone = init_argv[:-len(argv)]
        return alone[:-1] if alone[-1:] == ["--"] else alone
    if "--" in init_argv[1:]:
        return init_argv[:init_argv.index("--", 1)]
    return None


def plan_dump(runtime: str, name: str) -> DumpPlan:
    """How to dump container NAME's workload (the init's one child and its tree)."""
    c = inspect(runtime, name)
    kids = proc.live_children(c.init_pid)
    if len(kids) != 1:
        what = "no child: its PID 1 is the workload itself" if not kids else f"{len(kids)} children"
        raise FailedPrecondition(f"container {name!r} has {what}; memsnap checkpoints a container whose PID 1 is "
                                 "an init that reaps (podman run --init, tini) with one workload child")
    pid = kids[0]
    # (A placeholder's init was started alone: a restored container's checkpoint takes its argv as it is.)
    init_argv = _cmdline(c.init_pid) if c.placeholder else init_alone(_cmdline(c.init_pid), _cmdline(pid))
    if init_argv is None:
        raise FailedPrecondition(f"container {name!r}: its workload is no longer the command its init started (it "
                                 "exec'd another program), so memsnap cannot tell the init's own arguments from it; "
                                 "start the container with '--' between the init and the command (tini --, "
                                 "podman run --init)")
    stdio = {}
    for fd in ("0", "1", "2"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if _PIPE.fullmatch(link):
            stdio[fd] = link
    mounts = external_mounts(pid)
    facts = ContainerFacts(runtime=runtime, id=c.id, name=c.name, image=c.image, init_argv=init_argv,
                           network=c.network, mounts=mounts, stdio=stdio, pid_in_container=proc.innermost_pid(pid),
                           hostname=c.hostname if _HOSTNAME.fullmatch(c.hostname) else "",
                           volumes=[v for v in c.volumes if _volume_ok(v)])
    if len(facts.volumes) != len(c.volumes):
        raise FailedPrecondition(f"container {name!r} has a volume memsnap cannot mount again (a path with ':' or ',', "
                                 "or a volume type other than a named volume or a bind mount)")
    external = [f"net[{proc.ns_inode(pid, 'net')}]:{NET_KEY}", f"pid[{proc.ns_inode(pid, 'pid')}]:{PID_KEY}",
                *(f"mnt[{m}]:{m}" for m in mounts)]
    return DumpPlan(pid=pid, facts=facts, dump_opts={"root": c.rootfs, "cgroups_ignore": True, "external": external,
                                                     "shell_job": False})


@dataclass
class Placement:
    """A placeholder made for a restore, and the CRIU options that restore the tree into it."""

    name: str
    runtime: str
    running: Running
    restore_opts: dict[str, Any]
    fds: list[int]

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


def parse_into(into: str) -> tuple[str, str]:
    """(RUNTIME, NAME) for a restore target "podman:NAME" or "cri:NAME", else InvalidArgument."""
    got = parse_target(into)
    if got is None:
        raise InvalidArgument(f"--into {into[:80]!r}: name the placeholder to create as podman:NAME or cri:NAME")
    return got


def place(facts: ContainerFacts, into: str, binds_allowed: bool = True) -> Placement:
    """Starts the placeholder `into` names and prepares CRIU's options for it; the caller closes it (fds) and
    removes the container if the restore fails."""
    runtime, name = parse_into(into)
    if runtime != facts.runtime:
        raise FailedPrecondition(f"the checkpoint is of a {facts.runtime} container; restore it --into "
                                 f"{facts.runtime}:NAME")
    running = run_placeholder(facts, name, binds_allowed)
    fds: list[int] = []
    try:
        init = running.init_pid
        if proc.live_children(init):  # (never a second workload: init_alone())
            raise FailedPrecondition(f"the placeholder {name!r}'s init started a program of its own: memsnap restores "
                                     "only into an init that runs alone")
        if facts.pid_in_container and os.path.exists(f"/proc/{init}/root/proc/{facts.pid_in_container}"):
            raise FailedPrecondition(f"pid {facts.pid_in_container} is taken in the placeholder {name!r}")

        def opened(path: str, flags: int) -> int:
            fd = os.open(path, flags | os.O_CLOEXEC)
            fds.append(fd)
            return fd
        inherit = {PID_KEY: opened(f"/proc/{init}/ns/pid", os.O_RDONLY),
                   NET_KEY: opened(f"/proc/{init}/ns/net", os.O_RDONLY)}
        for num, key in facts.stdio.items():
            if num != "0":  # (the init's stdout and stderr: the placeholder's log)
                inherit[key] = opened(f"/proc/{init}/fd/{num}", os.O_WRONLY)
        join = {ns: opened(f"/proc/{init}/ns/{ns}", os.O_RDONLY) for ns in ("ipc", "uts")}
        external = [f"mnt[{m}]:{host_path_of(init, m)}" for m in facts.mounts]
        log.info("placeholder %s started from image %s, its init is pid %d", name, facts.image[:12], init)
        opts = {"root": running.rootfs, "cgroups_ignore": True, "external": external, "inherit_fds": inherit,
                "join_ns": join, "cgroup_procs": cgroup_procs_files(init), "pidns_fd": inherit[PID_KEY]}
        return Placement(name=name, runtime=runtime, running=running, restore_opts=opts, fds=fds)
    except BaseException:
        for fd in fds:
            os.close(fd)
        remove(runtime, running.handle)
        raise
