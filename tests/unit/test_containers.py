"""memsnap.containers' pure logic: which targets name a container, which container facts a restore accepts from a
manifest, where a placeholder's mounts are bound from, and who may restore into a new container (fast; no podman;
tests/e2e/test_containers.py runs the real thing)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from memsnap import containers, validate
from memsnap.catalog import Catalog
from memsnap.containers import ContainerFacts
from memsnap.engine import Caller, Engine, EngineConfig
from memsnap.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from memsnap.mounts import Mount
from memsnap.tier import MemoryTier

pytestmark = pytest.mark.unit


def facts(**kw: Any) -> dict[str, Any]:
    d = ContainerFacts(runtime="podman", id="a" * 64, name="web", image="b" * 64, init_argv=["/memtick", "reap"],
                       network="none", mounts=["/etc/hosts", "/dev/shm", "/sys/fs/cgroup/cpu"],
                       stdio={"1": "pipe:[123]", "2": "pipe:[124]"}, pid_in_container=6).to_dict()
    d.update(kw)
    return d


def test_a_container_target_is_runtime_colon_name_and_anything_else_is_not_a_container() -> None:
    assert containers.parse_target("podman:web") == ("podman", "web")
    assert containers.parse_target("podman:" + "f" * 64) == ("podman", "f" * 64)
    assert containers.parse_target("cri:" + "e" * 64) == ("cri", "e" * 64)
    assert containers.parse_target("1234") is None
    assert containers.parse_target("job-1") is None
    assert containers.parse_target("1000:train") is None  # (UID:NAME, a job)
    for bad in ("podman:", "podman:../x", "podman:a/b", "podman:-x", "podman:a b"):
        with pytest.raises(InvalidArgument):
            containers.parse_target(bad)


@pytest.mark.parametrize(("init", "workload", "alone"), [
    (["/memtick", "reap", "/memtick", "--mib", "8"], ["/memtick", "--mib", "8"], ["/memtick", "reap"]),
    (["/sbin/tini", "-g", "--", "python3", "x.py"], ["python3", "x.py"], ["/sbin/tini", "-g"]),
    (["/run/podman-init", "--", "/bin/sh", "-c", "exec python3 x.py"], ["python3", "x.py"], ["/run/podman-init"]),
    (["/memtick", "reap", "--", "/bin/sh", "-c", "exec /memtick"], ["/memtick"], ["/memtick", "reap"]),
    (["/memtick", "reap", "/bin/sh", "-c", "exec /memtick"], ["/memtick"], None),
    (["/sbin/tini", "python3"], ["python3", "-m", "x"], None),
    (["/sbin/tini", "python3"], [], None),
])
def test_the_placeholder_runs_the_init_alone_or_the_checkpoint_is_refused(
        init: list[str], workload: list[str], alone: list[str] | None) -> None:
    assert containers.init_alone(init, workload) == alone


def test_the_api_validates_container_targets_and_placeholders_as_names() -> None:
    assert validate.key("target", "podman:web") == "podman:web"
    assert validate.container("into", "podman:web-2") == "podman:web-2"
    assert validate.container("into", "cri:trainer-0") == "cri:trainer-0"
    assert validate.container("into", "", allow_empty=True) == ""
    for bad in ("podman:../../etc", "docker:web", "web", "podman:web/x", "podman:" + "a" * 200):
        with pytest.raises(InvalidArgument):
            validate.container("into", bad)
    with pytest.raises(InvalidArgument):
        validate.key("target", "podman:../x")


VOL = {"kind": "volume", "source": "data-1", "destination": "/data", "rw": True}
BIND = {"kind": "bind", "source": "/srv/conf", "destination": "/conf", "rw": False}


def test_container_facts_from_a_manifest_round_trip() -> None:
    f = ContainerFacts.from_manifest(facts())
    assert f.to_dict() == facts()
    f = ContainerFacts.from_manifest(facts(volumes=[VOL, BIND]))
    assert f.to_dict() == facts(volumes=[VOL, BIND]) and f.volumes == [VOL, BIND]


@pytest.mark.parametrize("change", [
    {"runtime": "docker"}, {"mounts": ["/etc/../root"]}, {"mounts": ["relative"]}, {"mounts": ["/"]},
    {"mounts": ["/x]:/etc/shadow"]}, {"stdio": {"1": "/etc/shadow"}}, {"stdio": {"7": "pipe:[1]"}},
    {"init_argv": []}, {"init_argv": [1]}, {"image": None}, {"network": 3}, {"hostname": "-x"},
    {"hostname": "a b"}, {"hostname": 7}, {"volumes": [{**VOL, "source": "../x"}]},
    {"volumes": [{**BIND, "source": "/a:/etc"}]}, {"volumes": [{**BIND, "source": "relative"}]},
    {"volumes": [{**BIND, "source": "/srv/../etc"}]}, {"volumes": [{**VOL, "destination": "/d,ro"}]},
    {"volumes": [{**VOL, "kind": "tmpfs"}]}, {"volumes": [{**VOL, "rw": "yes"}]}, {"volumes": [{**VOL, "x": 1}]},
    {"volumes": ["data-1:/data"]}])
def test_malformed_container_facts_are_refused(change: dict[str, Any]) -> None:
    with pytest.raises(FailedPrecondition):
        ContainerFacts.from_manifest(facts(**change))
    with pytest.raises(FailedPrecondition):
        ContainerFacts.from_manifest("not a dict")


def test_a_placeholder_mounts_the_same_volumes_if_this_node_has_them_and_a_peer_s_image_no_host_path(
        monkeypatch: Any, tmp_path: Path) -> None:
    import subprocess

    here = {"data-1"}
    monkeypatch.setattr(containers, "_podman", lambda *a, **k: subprocess.CompletedProcess(
        a, 0 if a[:2] == ("volume", "exists") and a[2] in here else 1, "", ""))
    bind = {**BIND, "source": str(tmp_path)}
    f = ContainerFacts.from_manifest(facts(volumes=[VOL, bind]))
    assert containers.volume_args(f, binds_allowed=True) == ["-v", "data-1:/data:rw", "-v", f"{tmp_path}:/conf:ro"]
    with pytest.raises(FailedPrecondition, match="not restored from another node's image"):
        containers.volume_args(f, binds_allowed=False)
    here.clear()
    with pytest.raises(FailedPrecondition, match="volume 'data-1' .* is not on this node"):
        containers.volume_args(f, binds_allowed=True)
    gone = ContainerFacts.from_manifest(facts(volumes=[{**BIND, "source": str(tmp_path / "gone")}]))
    with pytest.raises(FailedPrecondition, match="is not on this node"):
        containers.volume_args(gone, binds_allowed=True)


def _m(dev: str, root: str, point: str, fstype: str, super_opts: str) -> Mount:
    return Mount(0, 0, dev, root, point, fstype, "none",
                 tuple((k, v) for k, _, v in (o.partition("=") for o in super_opts.split(","))))


def test_a_placeholder_mount_is_bound_from_the_host_mount_of_the_same_filesystem(monkeypatch: Any) -> None:
    theirs = [_m("0:41", "/", "/", "overlay", "rw"),
              _m("254:0", "/run/containers/x/userdata/hosts", "/etc/hosts", "ext4", "rw"),
              _m("0:52", "/", "/dev/shm", "tmpfs", "rw"),
              _m("0:29", "/libpod_parent/libpod-x", "/sys/fs/cgroup/cpu", "cgroup", "rw,cpu")]
    ours = [_m("254:0", "/", "/", "ext4", "rw"),
            _m("0:52", "/", "/var/lib/containers/x/userdata/shm", "tmpfs", "rw"),
            _m("0:29", "/", "/sys/fs/cgroup/cpu", "cgroup", "rw,cpu"),
            _m("0:29", "/libpod_parent", "/elsewhere", "cgroup", "rw,cpu")]
    monkeypatch.setattr(containers, "mountinfo", lambda pid: ours if pid == "self" else theirs)
    assert containers.host_path_of(42, "/etc/hosts") == "/run/containers/x/userdata/hosts"
    assert containers.host_path_of(42, "/dev/shm") == "/var/lib/containers/x/userdata/shm"
    # (the host mount whose root holds it most closely)
    assert containers.host_path_of(42, "/sys/fs/cgroup/cpu") == "/elsewhere/libpod-x"
    with pytest.raises(FailedPrecondition, match="no mount at /etc/resolv.conf"):
        containers.host_path_of(42, "/etc/resolv.conf")
    assert containers.external_mounts.__doc__  # (reads the same tables)
    monkeypatch.setattr(containers, "mountinfo", lambda pid: ours if pid == "self" else theirs)
    assert containers.external_mounts(42) == ["/etc/hosts", "/dev/shm", "/sys/fs/cgroup/cpu"]


def test_a_host_mount_outside_the_filesystem_root_is_never_used(monkeypatch: Any) -> None:
    theirs = [_m("0:29", "/a/b", "/sys/fs/cgroup/cpu", "cgroup", "rw,cpu")]
    ours = [_m("0:29", "/c", "/mnt/c", "cgroup", "rw,cpu")]
    monkeypatch.setattr(containers, "mountinfo", lambda pid: ours if pid == "self" else theirs)
    with pytest.raises(FailedPrecondition, match="not reachable"):
        containers.host_path_of(42, "/sys/fs/cgroup/cpu")


def test_only_root_may_restore_into_a_new_container(tmp_path: Path) -> None:
    cat = Catalog(tmp_path / "state")
    e = Engine(EngineConfig(state_dir=tmp_path / "state"), cat, MemoryTier(tmp_path / "tier"), None,  # type: ignore[arg-type]
               b"k" * 32)
    try:
        with pytest.raises(PermissionDenied, match="only root"):
            e.restore(Caller(1000, 1000), "ck-x", into="podman:web2")
        with pytest.raises(InvalidArgument):
            e.restore(Caller(0), "ck-x", into="docker:web2")
    finally:
        cat.close()


def test_no_one_but_root_gets_the_runtime_asked_about_a_container() -> None:
    containers.authorize(True)
    with pytest.raises(PermissionDenied, match="only root"):
        containers.authorize(False)


def test_a_container_s_checkpoints_are_found_by_runtime_and_name_or_id_and_listed_as_its(tmp_path: Path) -> None:
    from memsnap.catalog import CheckpointRecord
    from memsnap.manifest import Manifest

    meta = Manifest(id="ck-0", pid=7, job="", name="web", uid=0, files={}, argv=["/memtick"],
                    extra={"container": facts(name="web")}).catalog_meta()
    assert containers.of_checkpoint(meta) == "podman:web"
    assert containers.of_checkpoint({}) == ""
    assert containers.is_of(meta, "podman:web") and containers.is_of(meta, "podman:" + "a" * 64)
    assert containers.is_of(meta, "podman:" + "a" * 12) and not containers.is_of(meta, "podman:" + "a" * 11)
    assert not containers.is_of(meta, "cri:web") and not containers.is_of(meta, "podman:db")
    assert not containers.is_of(meta, "web") and not containers.is_of({}, "podman:web")

    cat = Catalog(tmp_path / "state")
    e = Engine(EngineConfig(state_dir=tmp_path / "state"), cat, MemoryTier(tmp_path / "tier"), None,  # type: ignore[arg-type]
               b"k" * 32)
    try:
        for i, (uid, m) in enumerate([(0, meta), (0, {}), (1000, meta)]):
            cat.add_checkpoint(CheckpointRecord(id=f"ck-{i}", state="durable", pid=7, owner_uid=uid, created_ms=i,
                                                name="web", meta=m))
        assert [r.id for r in e.list_checkpoints(Caller(0), "podman:web")] == ["ck-0", "ck-2"]
        assert [r.id for r in e.list_checkpoints(Caller(1000, 1000), "podman:web")] == ["ck-2"]
        assert e.latest_restorable(Caller(0), "podman:web").id == "ck-2"
        with pytest.raises(NotFound, match="no restorable checkpoint of container"):
            e.latest_restorable(Caller(0), "cri:web")
    finally:
        cat.close()


def test_a_named_cgroup_hierarchy_is_found_by_its_name_beside_the_controllers(tmp_path: Path) -> None:
    # CRIU is started inside the placeholder's cgroups: each of its v1 hierarchies, name=systemd included (the
    # mount's options say "name=systemd"), and the v2 one.
    for d in ("systemd/libpod-x", "cpu,cpuacct/libpod-x", "unified/libpod-x"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "cgroup.procs").write_text("")
    host = [_m("0:29", "/", str(tmp_path / "systemd"), "cgroup", "rw,xattr,name=systemd"),
            _m("0:30", "/", str(tmp_path / "cpu,cpuacct"), "cgroup", "rw,cpu,cpuacct"),
            _m("0:31", "/", str(tmp_path / "unified"), "cgroup2", "rw")]
    got = containers.procs_files("9:name=systemd:/libpod-x\n3:cpu,cpuacct:/libpod-x\n0::/libpod-x\n", host)
    assert got == [str(tmp_path / d / "libpod-x" / "cgroup.procs") for d in ("systemd", "cpu,cpuacct", "unified")]
