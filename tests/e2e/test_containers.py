"""Containers (issue 33): a real podman container's workload checkpointed from the host and restored into a
placeholder container that memsnap starts from the same image, with its memory digest and its logs going on.

The image is built locally by scripts/containers/build-test-image.sh (busybox and tests/workloads/memtick.c, no
registry); scripts/setup.sh --test installs podman (scripts/containers/setup-podman.sh).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.e2e.test_security_jobs import call_as
from tests.helpers import NOBODY, REPO, DaemonProc, assert_node_healthy, wait_for

MIB = 256


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: {r.stderr.strip()}")
    return r


@pytest.fixture(scope="module")
def image() -> str:
    if shutil.which("podman") is None:
        pytest.fail("podman is not installed: run scripts/containers/setup-podman.sh (scripts/setup.sh --test does)")
    r = subprocess.run([str(REPO / "scripts" / "containers" / "build-test-image.sh")], capture_output=True,
                       text=True, timeout=300, check=True)
    return r.stdout.strip().splitlines()[-1]


@pytest.fixture
def names() -> Iterator[list[str]]:
    """Container names for one test, each unique; every container so named is removed at teardown."""
    made: list[str] = []
    yield made
    for n in made:
        podman("rm", "-f", "-t", "0", n, check=False)


def new_name(names: list[str], what: str) -> str:
    n = f"ms-{what}-{secrets.token_hex(3)}"
    names.append(n)
    return n


def start(image: str, name: str, mib: int = MIB) -> str:
    """Starts container NAME (the test workload, mib MiB, under 'memtick reap') and waits until it ticks; its
    digest of its memory at the start."""
    podman("run", "-d", "--name", name, "--network", "none", image,
           "/memtick", "reap", "/memtick", "--mib", str(mib), "--interval-ms", "100", "--digest-every", "10")
    wait_for(lambda: len(ticks(logs(name))) >= 2, 60, what="the container's workload to tick")
    return start_digest(logs(name))


def logs(name: str) -> str:
    r = podman("logs", name, check=False)
    return r.stdout + r.stderr


def goes_on(ticks_now: Callable[[], list[tuple[int, str, bool]]], last: int, digest: str, what: str) -> None:
    """A restored workload's log (ticks_now: its ticks) goes on where the dumped one stopped (tick last + 1) and,
    past tick last + 10, has computed its digest again from its memory: every digest it printed is the dumped
    one's."""
    wait_for(lambda: any(f for t, _, f in ticks_now() if t > last + 10), 60, what=what)
    after = ticks_now()
    assert after[0][0] == last + 1, f"its log starts at tick {after[0][0]}, the dumped workload's ended at {last}"
    assert {d for _, d, _ in after} == {digest}, "the restored workload's memory differs from the dumped one"


def ticks(text: str) -> list[tuple[int, str, bool]]:
    return [(int(m.group(1)), m.group(2), bool(m.group(3)))
            for m in re.finditer(r"^tick (\d+) ([0-9a-f]{16})( fresh)?$", text, re.M)]


def start_digest(text: str) -> str:
    m = re.search(r"^start ([0-9a-f]{16})$", text, re.M)
    assert m, text[-500:]
    return m.group(1)


def state(name: str) -> dict:
    return json.loads(podman("container", "inspect", "--format", "json", name).stdout)[0]["State"]


def ns(pid: int, kind: str) -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


def in_pidns(pid: int) -> list[int]:
    """The host pids of every process (zombies too) in pid's PID namespace."""
    want, out = os.stat(f"/proc/{pid}/ns/pid").st_ino, []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{p}/ns/pid").st_ino == want:
                out.append(int(p))
        except OSError:
            pass
    return out


def cgroups(pid: int) -> str:
    with open(f"/proc/{pid}/cgroup") as f:
        return f.read()


def test_a_container_checkpointed_to_the_store_comes_back_in_a_placeholder_with_its_memory_and_its_logs(
        daemon: DaemonProc, image: str, names: list[str]) -> None:
    src, dst = new_name(names, "src"), new_name(names, "dst")
    digest = start(image, src)

    ck = json.loads(daemon.ctl("--json", "checkpoint", f"podman:{src}", "--stop", "--wait", "durable",
                               check=True).stdout)
    assert ck["name"] == src
    wait_for(lambda: not state(src)["Running"], 30, what="the source container to end with its workload")
    last = max(t for t, _, _ in ticks(logs(src)))
    daemon.ctl("evict", ck["id"], check=True)  # (the restore comes from the store)
    # list and show name the container; a restore names it too (its newest checkpoint).
    listed = json.loads(daemon.ctl("--json", "list", "--job", f"podman:{src}", check=True).stdout)
    assert [(c["id"], c["container"]) for c in listed] == [(ck["id"], f"podman:{src}")]
    assert f"container   podman:{src}" in daemon.ctl("show", ck["id"], check=True).stdout

    r = json.loads(daemon.ctl("--json", "restore", f"podman:{src}", "--into", f"podman:{dst}", check=True).stdout)
    assert r["checkpoint"] == ck["id"] and r["from_store"] and r["into"] == f"podman:{dst}"
    goes_on(lambda: ticks(logs(dst)), last, digest, "the restored workload to compute its digest again in the "
            "placeholder")

    # The tree lives in the placeholder: its PID, network, IPC and UTS namespaces, its cgroups.
    init = int(state(dst)["Pid"])
    assert r["pid"] != init and os.path.exists(f"/proc/{init}/task/{init}/children")
    for kind in ("pid", "net", "ipc", "uts"):
        assert ns(r["pid"], kind) == ns(init, kind), f"restored into another {kind} namespace"
    assert cgroups(r["pid"]) == cgroups(init)
    assert str(r["pid"]) in open(f"/proc/{init}/task/{init}/children").read().split()
    # Nothing else in there: CRIU and the shell that started it there are gone (and reaped by the init).
    wait_for(lambda: sorted(in_pidns(init)) == sorted([init, r["pid"]]), 10,
             what="the placeholder to hold its init and the workload only")
    assert_node_healthy(daemon)

    # The next generation: the placeholder is checkpointed and restored in turn (its init, started alone, is the
    # next placeholder's command: one workload, not two).
    ck2 = json.loads(daemon.ctl("--json", "checkpoint", f"podman:{dst}", "--stop", check=True).stdout)
    last = max(t for t, _, _ in ticks(logs(dst)))
    dst2 = new_name(names, "dst2")
    r = json.loads(daemon.ctl("--json", "restore", ck2["id"], "--into", f"podman:{dst2}", check=True).stdout)
    goes_on(lambda: ticks(logs(dst2)), last, digest, "the second generation to compute its digest again")
    init = int(state(dst2)["Pid"])
    wait_for(lambda: sorted(in_pidns(init)) == sorted([init, r["pid"]]), 10,
             what="the second placeholder to hold its init and the workload only")
    assert_node_healthy(daemon)

    podman("stop", "-t", "10", dst2)  # (its init passes SIGTERM on and ends with the workload)
    assert state(dst2)["ExitCode"] == 128 + 15


def test_a_container_restore_that_cannot_start_its_placeholder_fails_cleanly_and_stays_restorable(
        daemon: DaemonProc, image: str, names: list[str]) -> None:
    # An image of its own (the same files, another id), removed after the checkpoint: the placeholder cannot start.
    doomed = f"localhost/memsnap-doomed:{secrets.token_hex(3)}"
    made = podman("create", image).stdout.strip()
    podman("commit", "--change", f"LABEL memsnap.test={doomed}", made, doomed)
    podman("rm", made)
    src, taken, dst = new_name(names, "src"), new_name(names, "taken"), new_name(names, "dst")
    start(doomed, src, mib=32)
    start(image, taken, mib=8)
    ck = json.loads(daemon.ctl("--json", "checkpoint", f"podman:{src}", "--stop", check=True).stdout)

    # Without --into, and into a name that is taken (never entered: that container runs on, untouched).
    r = daemon.ctl("restore", ck["id"])
    assert r.returncode != 0 and "--into podman:NEWNAME" in r.stderr, r.stderr
    before = ticks(logs(taken))[-1][0]
    r = daemon.ctl("restore", ck["id"], "--into", f"podman:{taken}")
    assert r.returncode != 0 and "exists already" in r.stderr, r.stderr
    wait_for(lambda: ticks(logs(taken))[-1][0] > before + 2, 30, what="the other container to tick on")
    assert len(podman("container", "inspect", "--format", "{{.State.Pid}}", taken).stdout.split()) == 1

    podman("rm", "-f", "-t", "0", src)
    podman("rmi", doomed)
    r = daemon.ctl("restore", ck["id"], "--into", f"podman:{dst}")
    assert r.returncode != 0 and "is not on this node" in r.stderr, r.stderr
    assert podman("container", "exists", dst, check=False).returncode == 1, "a failed restore left its placeholder"
    assert_node_healthy(daemon)
    assert json.loads(daemon.ctl("--json", "show", ck["id"], check=True).stdout)["state"] in ("staged", "durable")


def test_containers_are_root_s_to_checkpoint_and_restore_not_nobody_s(
        open_daemon: DaemonProc, image: str, names: list[str]) -> None:
    src, dst = new_name(names, "src"), new_name(names, "dst")
    start(image, src, mib=8)

    code, msg = call_as(NOBODY, open_daemon, "checkpoint", f"podman:{src}")
    assert code == "PERMISSION_DENIED", msg
    ticks_on(src)

    ck = json.loads(open_daemon.ctl("--json", "checkpoint", f"podman:{src}", check=True).stdout)
    code, msg = call_as(NOBODY, open_daemon, "restore", ck["id"], into=f"podman:{dst}")
    assert code == "PERMISSION_DENIED", msg
    assert podman("container", "exists", dst, check=False).returncode == 1
    code, msg = call_as(NOBODY, open_daemon, "restore", ck["id"], into="podman:../../etc")
    assert code == "INVALID_ARGUMENT", msg
    # Named by its container: root's checkpoint is neither listed to nobody nor restored for it.
    code, listed = call_as(NOBODY, open_daemon, "list", f"podman:{src}")
    assert code == "OK" and not listed, listed
    assert len(call_as(0, open_daemon, "list", f"podman:{src}")[1]) == 1  # (root, the same call: it is there)
    code, msg = call_as(NOBODY, open_daemon, "restore", f"podman:{src}", into=f"podman:{dst}")
    assert code in ("PERMISSION_DENIED", "NOT_FOUND") and ck["id"] not in msg, msg
    assert podman("container", "exists", dst, check=False).returncode == 1


def test_a_container_restore_whose_placeholder_dies_before_criu_fails_cleanly_and_stays_restorable(
        make_daemon: object, image: str, names: list[str]) -> None:
    d = make_daemon("slow", env={"MEMSNAP_FAILPOINTS": "slow-placeholder"}).start()  # type: ignore[operator]
    src, dst = new_name(names, "src"), new_name(names, "dst")
    start(image, src, mib=32)
    ck = json.loads(d.ctl("--json", "checkpoint", f"podman:{src}", "--stop", check=True).stdout)
    env = {**os.environ, "PYTHONPATH": str(REPO), "MEMSNAP_SOCKET": d.socket}
    restoring = subprocess.Popen([sys.executable, "-m", "memsnap.cli", "restore", ck["id"], "--into",
                                  f"podman:{dst}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: f"placeholder {dst} started" in d.log.read_text(), 30, what="memsnap to start the placeholder")
    podman("kill", dst)  # (memsnap waits 3 s before CRIU: the placeholder is gone by then)
    _, err = restoring.communicate(timeout=120)
    assert restoring.returncode != 0 and f"restore of {ck['id']} failed" in err, err
    assert podman("container", "exists", dst, check=False).returncode == 1, "a failed restore left its placeholder"
    assert_node_healthy(d, restorable={ck["id"]})



def test_a_restore_whose_criu_stalls_in_the_placeholder_is_killed_at_the_deadline_and_leaves_nothing_behind(
        make_daemon: Any, image: str, names: list[str]) -> None:
    # CRIU runs inside the placeholder (the init's child, not the daemon's): the progress watch must find it there.
    d = make_daemon("stall", env={"MEMSNAP_CRIU_STALL_S": "3", "MEMSNAP_FAILPOINTS": "slow-placeholder"}).start()
    src, dst = new_name(names, "src"), new_name(names, "dst")
    start(image, src)
    ck = json.loads(d.ctl("--json", "checkpoint", f"podman:{src}", "--stop", check=True).stdout)
    env = {**os.environ, "PYTHONPATH": str(REPO), "MEMSNAP_SOCKET": d.socket}
    restoring = subprocess.Popen([sys.executable, "-m", "memsnap.cli", "restore", ck["id"], "--into",
                                  f"podman:{dst}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: f"placeholder {dst} started" in d.log.read_text(), 30, what="memsnap to start the placeholder")
    init = int(state(dst)["Pid"])

    def stop_criu() -> int:
        for pid in in_pidns(init):
            try:
                if open(f"/proc/{pid}/comm").read().strip() == "criu":
                    os.kill(pid, signal.SIGSTOP)
                    return pid
            except OSError:
                pass
        return 0
    stopped = int(wait_for(stop_criu, 15, interval=0.002, what="CRIU to start in the placeholder"))  # type: ignore[arg-type]
    _, err = restoring.communicate(timeout=120)
    assert restoring.returncode != 0 and "made no progress" in err, err
    assert f"criu restore (pid {stopped}) made no progress" in d.log.read_text()  # (the one in the placeholder)
    assert podman("container", "exists", dst, check=False).returncode == 1, "a stalled restore left its placeholder"
    wait_for(lambda: not os.path.exists(f"/proc/{stopped}"), 10, what="the stalled CRIU to be gone")
    assert_node_healthy(d, restorable={ck["id"]})


@pytest.mark.parametrize("point", ["placeholder-started", "restored-into-placeholder"])
def test_a_daemon_killed_mid_restore_into_a_placeholder_removes_it_when_it_restarts_and_the_restore_works_again(
        point: str, make_daemon: Any, image: str, names: list[str]) -> None:
    # Killed with the placeholder running (before CRIU), or with the tree restored in it but no job recorded.
    d = make_daemon("crash", env={"MEMSNAP_FAILPOINTS": point}).start()
    src, dst = new_name(names, "src"), new_name(names, "dst")
    digest = start(image, src, mib=32)
    ck = json.loads(d.ctl("--json", "checkpoint", f"podman:{src}", "--stop", check=True).stdout)
    last = max(t for t, _, _ in ticks(logs(src)))
    r = d.ctl("restore", ck["id"], "--into", f"podman:{dst}")
    assert r.returncode != 0 and d.proc is not None and d.proc.wait(30) == 137, r.stderr
    assert podman("container", "exists", dst, check=False).returncode == 0  # (left by the dead daemon)

    d.env = {}
    d.start()
    assert podman("container", "exists", dst, check=False).returncode == 1, "the restart left the placeholder"
    assert "removed placeholder podman:" + dst in d.log.read_text()
    assert_node_healthy(d, restorable={ck["id"]})
    # The same name again: a new placeholder, and the workload goes on from its checkpoint.
    d.ctl("restore", ck["id"], "--into", f"podman:{dst}", check=True)
    goes_on(lambda: ticks(logs(dst)), last, digest, "the restored workload to compute its digest again")
    assert_node_healthy(d)


def test_a_container_restored_lazily_from_the_store_pages_its_memory_in_inside_the_placeholder(
        daemon: DaemonProc, image: str, names: list[str]) -> None:
    src, dst = new_name(names, "src"), new_name(names, "dst")
    digest = start(image, src)
    ck = json.loads(daemon.ctl("--json", "checkpoint", f"podman:{src}", "--stop", "--wait", "durable",
                               check=True).stdout)
    last = max(t for t, _, _ in ticks(logs(src)))
    daemon.ctl("evict", ck["id"], check=True)
    r = json.loads(daemon.ctl("--json", "restore", ck["id"], "--into", f"podman:{dst}", "--lazy",
                              check=True).stdout)
    assert r["from_store"]
    goes_on(lambda: ticks(logs(dst)), last, digest, "the restored workload to compute its digest again from pages "
            "it faulted in")
    init = int(state(dst)["Pid"])
    assert ns(r["pid"], "pid") == ns(init, "pid") and ns(r["pid"], "net") == ns(init, "net")
    assert f"lazy restore of {ck['id']} from the store: every page resident" in daemon.log.read_text()
    assert_node_healthy(daemon)


@pytest.mark.parametrize("how", ["--lazy", "--via-store"])
def test_a_container_moved_lazily_or_through_the_store_goes_on_in_a_placeholder_on_the_target(
        how: str, pair: Any, image: str, names: list[str], tmp_path: Any) -> None:
    from tests.helpers import token_daemon

    a = pair.a
    b = token_daemon(tmp_path / "b", pair.token_file)
    if how == "--via-store":  # (one store both nodes reach)
        b.extra += ["--store-dir", str(a.store), "--hmac-key-file", str(a.state / "hmac.key")]
    b.start()
    try:
        src, dst = new_name(names, "src"), new_name(names, "dst")
        digest = start(image, src)
        r = a.ctl("--json", "migrate", f"podman:{src}", "--to", b.address, "--into", f"podman:{dst}", how,
                  timeout=300)
        assert r.returncode == 0, r.stderr + a.log.read_text()[-2000:] + b.log.read_text()[-2000:]
        out = json.loads(r.stdout)
        last = max(t for t, _, _ in ticks(logs(src)))
        goes_on(lambda: ticks(logs(dst)), last, digest, "the moved workload to compute its digest again in the "
                "placeholder")
        init = int(state(dst)["Pid"])
        assert ns(out["target_pid"], "pid") == ns(init, "pid")
        wait_for(lambda: not state(src)["Running"], 30, what="the source container to end")
        # (Through the store, the move's durable checkpoint stays on the source, as for any job's move.)
        assert_node_healthy(a, restorable={out["checkpoint"]} if how == "--via-store" else set())
        assert_node_healthy(b)
    finally:
        b.cleanup()


def test_a_container_move_the_source_never_commits_takes_its_placeholder_away_and_can_be_made_again(
        image: str, names: list[str], tmp_path: Any) -> None:
    from tests.helpers import secret_file, token_daemon

    token = secret_file(tmp_path / "node.token")
    # The source dies (kill -9) once the target said the workload runs there, before it asks the target to keep it.
    a = token_daemon(tmp_path / "a", token, env={"MEMSNAP_FAILPOINTS": "before-commit-sent"})
    b = token_daemon(tmp_path / "b", token, more="move_commit_timeout_s = 5")
    try:
        a.start()
        b.start()
        src, dst = new_name(names, "src"), new_name(names, "dst")
        digest = start(image, src, mib=32)
        r = a.ctl("migrate", f"podman:{src}", "--to", b.address, "--into", f"podman:{dst}")
        assert r.returncode != 0 and a.proc is not None and a.proc.wait(10) == 137, r.stderr
        wait_for(lambda: ticks(logs(dst)), 30, what="the target's copy to tick in its placeholder")
        # Never committed: once the commit timeout runs out, the target kills its copy and removes the placeholder.
        wait_for(lambda: podman("container", "exists", dst, check=False).returncode == 1, 60,
                 what="the uncommitted move's placeholder to go")
        assert_node_healthy(b, restorable=set())
        # The source's workload, held by the move, runs on once its daemon is back; the move works again.
        a.env = {}
        a.start()
        ticks_on(src)
        r = a.ctl("--json", "migrate", f"podman:{src}", "--to", b.address, "--into", f"podman:{dst}", timeout=300)
        assert r.returncode == 0, r.stderr
        last = max(t for t, _, _ in ticks(logs(src)))
        goes_on(lambda: ticks(logs(dst)), last, digest, "the moved workload to compute its digest again")
        assert_node_healthy(a, restorable=set())
        assert_node_healthy(b)
    finally:
        a.cleanup()
        b.cleanup()


def test_a_container_move_without_a_placeholder_name_or_with_a_host_path_is_refused_before_it_is_touched(
        pair: Any, image: str, names: list[str], tmp_path: Any) -> None:
    a, b = pair.a, pair.b
    src, bound = new_name(names, "src"), new_name(names, "bound")
    start(image, src, mib=8)
    podman("run", "-d", "--name", bound, "--network", "none", "-v", f"{tmp_path}:/host", image,
           "/memtick", "reap", "/memtick", "--mib", "8", "--interval-ms", "100")
    for name, extra, says in ((src, [], "needs --into podman:NAME"),
                              (src, ["--into", "podman:x", "--tcp-established"], "is its placeholder's"),
                              (bound, ["--into", "podman:x"], f"bind-mounts host paths ({tmp_path}:/host)")):
        r = a.ctl("migrate", f"podman:{name}", "--to", b.address, *extra)
        assert r.returncode != 0 and says in r.stderr, r.stderr
    for name in (src, bound):
        ticks_on(name)


def ticks_on(name: str) -> None:
    """Container NAME's workload ticks on (it was never frozen, or it runs again)."""
    wait_for(lambda: len(ticks(logs(name))) >= 2, 30, what=f"{name} to tick")
    n = ticks(logs(name))[-1][0]
    wait_for(lambda: ticks(logs(name))[-1][0] > n + 2, 30, what=f"{name} to tick on")


def test_a_container_whose_workload_exec_d_without_a_double_dash_is_refused_and_never_frozen(
        daemon: DaemonProc, image: str, names: list[str]) -> None:
    # The placeholder would run "memtick reap /bin/sh -c ...": a second copy of the workload beside the restored one.
    src = new_name(names, "src")
    podman("run", "-d", "--name", src, "--network", "none", image, "/memtick", "reap", "/bin/sh", "-c",
           "exec /memtick --mib 8 --interval-ms 100")
    wait_for(lambda: len(ticks(logs(src))) >= 2, 60, what="the container's workload to tick")
    r = daemon.ctl("checkpoint", f"podman:{src}", "--stop")
    assert r.returncode != 0 and "'--' between the init and the command" in r.stderr, r.stderr
    ticks_on(src)
    assert_node_healthy(daemon)
    assert src not in daemon.ctl("--json", "list", check=True).stdout


def test_a_container_s_volumes_are_mounted_again_in_its_placeholder_and_a_missing_one_is_refused(
        daemon: DaemonProc, image: str, names: list[str], tmp_path: Any) -> None:
    # A named volume holding a file the workload keeps open (fd 3), and a read-only bind mount of a host directory.
    vol = f"ms-vol-{secrets.token_hex(3)}"
    podman("volume", "create", vol)
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "setting").write_text("42\n")
    src, dst, dst2 = new_name(names, "src"), new_name(names, "dst"), new_name(names, "dst2")
    try:
        podman("run", "-d", "--name", src, "--network", "none", "-v", f"{vol}:/data", "-v",
               f"{tmp_path / 'conf'}:/conf:ro", image, "/memtick", "reap", "--", "/bin/sh", "-c",
               "exec 3>>/data/log && exec /memtick --mib 32 --interval-ms 100 --digest-every 10")
        wait_for(lambda: len(ticks(logs(src))) >= 2, 60, what="the container's workload to tick")
        digest = start_digest(logs(src))
        data = json.loads(podman("volume", "inspect", vol).stdout)[0]["Mountpoint"]
        ck = json.loads(daemon.ctl("--json", "checkpoint", f"podman:{src}", "--stop", "--wait", "durable",
                                   check=True).stdout)
        last = max(t for t, _, _ in ticks(logs(src)))
        daemon.ctl("evict", ck["id"], check=True)
        r = json.loads(daemon.ctl("--json", "restore", ck["id"], "--into", f"podman:{dst}", check=True).stdout)
        goes_on(lambda: ticks(logs(dst)), last, digest, "the restored workload to compute its digest again")
        # Its open file is the volume's, and the placeholder has both mounts (the bind one read-only).
        assert os.stat(f"/proc/{r['pid']}/fd/3").st_ino == os.stat(f"{data}/log").st_ino
        from memsnap.mounts import mountinfo

        assert {"/data", "/conf"} <= {m.point for m in mountinfo(r["pid"])}
        with open(f"/proc/{r['pid']}/root/conf/setting") as f:
            assert f.read() == "42\n"
        assert_node_healthy(daemon)

        # Without the volume on this node the restore is refused: memsnap never creates it empty.
        ck2 = json.loads(daemon.ctl("--json", "checkpoint", f"podman:{dst}", "--stop", check=True).stdout)
        for name in (src, dst):
            podman("rm", "-f", "-t", "0", name)
        podman("volume", "rm", vol)
        r2 = daemon.ctl("restore", ck2["id"], "--into", f"podman:{dst2}")
        assert r2.returncode != 0 and f"volume '{vol}' (mounted at /data) is not on this node" in r2.stderr, r2.stderr
        assert podman("container", "exists", dst2, check=False).returncode == 1
        assert podman("volume", "exists", vol, check=False).returncode == 1
        assert_node_healthy(daemon)
    finally:
        for name in (src, dst, dst2):
            podman("rm", "-f", "-t", "0", name, check=False)
        podman("volume", "rm", "-f", vol, check=False)


def _get(ip: str, path: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://{ip}:8080{path}", timeout=5) as r:
        return r.read().decode().strip()


def ip_of(name: str) -> str:
    d = json.loads(podman("container", "inspect", "--format", "json", name).stdout)[0]
    return str(d["NetworkSettings"]["IPAddress"])


def test_a_web_server_in_a_container_restored_on_a_bridge_network_answers_at_the_placeholder_s_address(
        daemon: DaemonProc, image: str, names: list[str]) -> None:
    # busybox httpd serves /etc; /etc/hosts is a bind mount of the container's own (podman's), which names its
    # address: what the server answers says whose mount it sees. The hostname goes with the container.
    src, dst = new_name(names, "src"), new_name(names, "dst")
    podman("run", "-d", "--name", src, "--network", "bridge", "--hostname", src, image,
           "/memtick", "reap", "/bin/busybox", "httpd", "-f", "-p", "8080", "-h", "/etc")
    old_ip = ip_of(src)
    wait_for(lambda: _answers(old_ip) == src, 30, what="the server to answer")
    ck = json.loads(daemon.ctl("--json", "checkpoint", f"podman:{src}", "--stop", check=True).stdout)
    r = json.loads(daemon.ctl("--json", "restore", ck["id"], "--into", f"podman:{dst}", check=True).stdout)
    new_ip = ip_of(dst)
    assert new_ip and new_ip != old_ip  # (podman gives the placeholder an address of its own)
    # The restored server (its listening socket) answers there, and sees the placeholder's /etc/hostname.
    wait_for(lambda: _answers(new_ip) == src, 30, what="the restored server to answer at the placeholder's address")
    for _ in range(20):
        assert _get(new_ip, "/hostname") == src
    hosts = _get(new_ip, "/hosts")
    assert new_ip in hosts and old_ip not in hosts, hosts
    init = int(state(dst)["Pid"])
    assert ns(r["pid"], "net") == ns(init, "net")
    assert_node_healthy(daemon)


def _answers(ip: str) -> str:
    try:
        return _get(ip, "/hostname")
    except OSError:
        return ""
