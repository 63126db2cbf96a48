"""A hostile local user gets nothing: each attack runs for real, as uid 65534 over the real socket.

Covers what a job is started with (environment, cwd, groups, its log), names scoped by owner, store
index entries that are only hints, what can never be checkpointed, one daemon per state dir, socket and
port, and what Status shows to whom.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from memsnap.client import ClientError
from tests.helpers import NOBODY, REPO, DaemonProc, counter_argv, ticks, wait_for

DURABLE = 4

# Runs one client call; prints ["OK", result] or [code, message] as JSON.
_CALL = textwrap.dedent("""
    method, args, kwargs = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    try:
        r = getattr(c, method)(*args, **kwargs)
        out = ["OK", MessageToDict(r, preserving_proto_field_name=True) if hasattr(r, "DESCRIPTOR") else r]
    except ClientError as e:
        out = [e.code.name, e.message]
    print(json.dumps(out, default=str))
""")


def run_as(uid: int, code: str, *args: str, groups: tuple[int, ...] = (),
           sock: str = "") -> subprocess.CompletedProcess[str]:
    """A Python snippet run as uid (gid the same, these supplementary groups), with a client `c` of sock.
    Imports and the channel are set up as root, then every privilege is dropped before anything else:
    on this VM the interpreter's packages under /root are unreadable to other users. The connection,
    and so the peer credentials the daemon sees, is made as uid."""
    drop = textwrap.dedent(f"""
        import os, json, sys, grpc
        import google.protobuf.descriptor_pb2  # (imported lazily by MessageToDict)
        from google.protobuf.json_format import MessageToDict
        from memsnap.client import MemsnapClient, ClientError
        c = MemsnapClient(socket={sock!r}) if {bool(sock)} else None
        os.setgroups({list(groups)}); os.setgid({uid}); os.setuid({uid})
    """)
    return subprocess.run([sys.executable, "-c", drop + textwrap.dedent(code), *args], capture_output=True,
                          text=True, timeout=120, cwd="/", env={**os.environ, "PYTHONPATH": str(REPO)})


def call_as(uid: int, d: DaemonProc, method: str, *args: object, **kwargs: object) -> list:
    """A MemsnapClient call made by uid over d's socket: ["OK", result] or [CODE, message]."""
    r = run_as(uid, _CALL, method, json.dumps(args), json.dumps(kwargs), sock=d.socket)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A temp dir any user may traverse (0755): for sockets and files that nobody must reach."""
    d = Path(tempfile.mkdtemp(prefix="memsnap-sec-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def open_daemons(open_dir: Path) -> Iterator[object]:
    """Factory of daemons whose socket (0666) and state dir any local user reaches: only the daemon's own
    checks stand in the way of an attack run as nobody."""
    made: list[DaemonProc] = []

    def make(name: str, *extra: str) -> DaemonProc:
        base = open_dir / name
        base.mkdir(mode=0o755)
        cfg = base / "open.toml"
        cfg.write_text('[daemon]\nsocket_mode = "0666"\n')
        d = DaemonProc(base, extra=["--config", str(cfg), *extra])
        made.append(d)
        return d

    yield make
    for d in made:
        d.cleanup()


def _marker_lib(where: Path) -> tuple[Path, Path]:
    """A preload library whose constructor appends "EUID EXE" to a marker file, for every process it runs in."""
    marker = where / "marker.txt"
    marker.touch()
    marker.chmod(0o666)
    src = where / "marker.c"
    src.write_text(textwrap.dedent(f"""
        #include <stdio.h>
        #include <unistd.h>
        __attribute__((constructor)) static void mark(void) {{
            char exe[512] = {{0}};
            readlink("/proc/self/exe", exe, sizeof exe - 1);
            FILE *f = fopen("{marker}", "a");
            if (f) {{ fprintf(f, "%d %s\\n", (int)geteuid(), exe); fclose(f); }}
        }}
    """))
    lib = where / "marker.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    lib.chmod(0o755)
    return lib, marker


def _marks(marker: Path) -> list[tuple[int, str]]:
    return [(int(a), b) for a, _, b in (ln.partition(" ") for ln in marker.read_text().splitlines()) if a]


def test_ld_preload_from_a_callers_env_never_runs_as_root(open_daemons, jobs_to_kill, open_dir):
    d = open_daemons("preload").start()
    lib, marker = _marker_lib(open_dir)
    attack = {"LD_PRELOAD": str(lib), "PATH": "/usr/bin:/bin"}
    out = call_as(NOBODY, d, "run", ["/bin/sleep", "30"], env=attack, cwd="/")
    assert out[0] == "OK", out
    jobs_to_kill.append(int(out[1]["pid"]))
    wait_for(lambda: _marks(marker), 10, what="the job to load the preload library")
    marks = _marks(marker)
    assert all(uid == NOBODY for uid, _ in marks), marks  # the environment reached the job, and only it
    assert any(exe.endswith("sleep") for _, exe in marks), marks
    # A root caller's environment reaches its own (root) job, never unshare or setpriv.
    marker.write_text("")
    with d.client() as c:
        job = c.run(["/bin/sleep", "30"], env=attack)
    jobs_to_kill.append(int(job.pid))
    wait_for(lambda: any(exe.endswith("sleep") for _, exe in _marks(marker)), 10,
             what="root's job to load the preload library")
    # Only the job's own processes load it: its init (bash, memsnap.jobinit) and the command; never the
    # launcher's root steps (unshare, setpriv, the trampoline's python).
    assert {Path(exe).name for _, exe in _marks(marker)} <= {"bash", "sleep"}, _marks(marker)


def test_cwd_under_a_0700_root_dir_is_entered_as_the_caller_and_refused(open_daemons, open_dir):
    d = open_daemons("cwd").start()
    secret_dir = open_dir / "root-only"
    (secret_dir / "inner").mkdir(parents=True)
    secret_dir.chmod(0o700)
    (secret_dir / "inner").chmod(0o755)
    (secret_dir / "inner" / "secret").write_text("root's secret\n")
    (secret_dir / "inner" / "secret").chmod(0o644)
    out = call_as(NOBODY, d, "run", ["/bin/cat", "secret"], cwd=str(secret_dir / "inner"))
    assert out[0] == "FAILED_PRECONDITION" and "cannot enter" in out[1] and "65534" in out[1], out
    out = call_as(NOBODY, d, "run", ["/bin/cat", "secret"], cwd="relative/dir")
    assert out[0] == "INVALID_ARGUMENT", out
    with d.client() as c:
        assert [j for j in c.jobs() if j.owner_uid == NOBODY] == []


def test_job_runs_with_callers_groups_and_its_owner_reads_its_log(open_daemons, open_dir):
    d = open_daemons("groups").start()
    code = """
        j = c.run(["/bin/sh", "-c", "id -u; id -G; pwd"], cwd="/tmp")
        print(json.dumps({"log": j.log_path, "id": j.id}))
    """
    r = run_as(NOBODY, code, groups=(100,), sock=d.socket)
    assert r.returncode == 0, r.stderr
    log = json.loads(r.stdout)["log"]
    # The owner reads its own log directly (its file, in a dir nobody can list).
    read = run_as(NOBODY, "import sys; print(open(sys.argv[1]).read())", log)
    assert read.returncode == 0, read.stderr
    wait_for(lambda: "/tmp" in run_as(NOBODY, "import sys; print(open(sys.argv[1]).read())", log).stdout, 10)
    lines = run_as(NOBODY, "import sys; print(open(sys.argv[1]).read())", log).stdout.split("\n")
    assert lines[0] == str(NOBODY) and set(lines[1].split()) == {str(NOBODY), "100"} and lines[2] == "/tmp"
    # Another user can neither read it nor list the log dir.
    assert run_as(65533, "import sys; open(sys.argv[1]).read()", log).returncode != 0
    assert run_as(NOBODY, "import os, sys; os.listdir(sys.argv[1])", str(Path(log).parent)).returncode != 0
    assert run_as(NOBODY, "import sys; open(sys.argv[1]).read()", str(d.state / "catalog.db")).returncode != 0


def test_names_are_scoped_by_owner_so_roots_checkpoint_never_touches_nobodys_job(open_daemons, jobs_to_kill):
    d = open_daemons("names").start()
    theirs = call_as(NOBODY, d, "run", ["/bin/sleep", "60"], name="X")
    assert theirs[0] == "OK", theirs
    their_pid = int(theirs[1]["pid"])
    jobs_to_kill.append(their_pid)
    # A second live X of the same owner is refused.
    again = call_as(NOBODY, d, "run", ["/bin/sleep", "60"], name="X")
    assert again[0] == "FAILED_PRECONDITION" and "already runs" in again[1], again
    with d.client() as c:
        # Root has no X: it is told to name the owner, and nothing happens to nobody's X.
        with pytest.raises(ClientError) as e:
            c.checkpoint("X", stop=True)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "65534:X" in e.value.message
        mine = c.run(counter_argv(8), name="X")
        jobs_to_kill.append(int(mine.pid))
        wait_for(lambda: len(ticks(mine.log_path)) >= 2, 20, what="root's X to tick")
        ck = c.checkpoint("X", stop=True)
        assert ck.job == mine.id and ck.owner_uid == 0
        assert [k for k in c.list() if k.owner_uid == NOBODY] == []
        # Restore root's X; the restored copy exits; checkpoint X still finds the running job (the copy).
        r = c.restore("X")
        jobs_to_kill.append(int(r.pid))
        wait_for(lambda: ticks(mine.log_path, int(r.pid)), 20, what="the restored X to tick")
        ck2 = c.checkpoint("X")
        assert ck2.job == r.job.id
        r2 = c.restore(ck.id)
        jobs_to_kill.append(int(r2.pid))
        os.kill(int(r2.pid), 9)
        wait_for(lambda: not Path(f"/proc/{r2.pid}").exists(), 10)
        assert c.checkpoint("X").job == r.job.id
    assert Path(f"/proc/{their_pid}").exists()
    # nobody may not name root's jobs, and its own name resolves to its own job.
    assert call_as(NOBODY, d, "checkpoint", "0:X")[0] == "PERMISSION_DENIED"
    assert call_as(NOBODY, d, "restore", "X")[0] == "NOT_FOUND"  # root's checkpoints of X are not nobody's


def test_injected_store_index_entry_never_restores_another_job(make_daemon, open_daemons, jobs_to_kill, tmp_path):
    key = tmp_path / "cluster.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    shared = tmp_path / "shared-store"
    a = make_daemon("node-a", extra=["--hmac-key-file", str(key), "--store-dir", str(shared)]).start()
    b = open_daemons("node-b", "--hmac-key-file", str(key),
                     "--store-dir", str(shared)).start()
    cks = {}
    with a.client() as c:
        for name in ("alpha", "beta"):
            job = c.run(counter_argv(8), name=name)
            jobs_to_kill.append(int(job.pid))
            wait_for(lambda job=job: len(ticks(job.log_path)) >= 2, 20)
            cks[name] = c.checkpoint(job.id, stop=True, wait_durable=True)
            assert cks[name].state == DURABLE
            time.sleep(1.1)  # beta's id sorts after alpha's: the newest entry under alpha is the planted one
    (shared / "_index" / "alpha" / cks["beta"].id).write_bytes(b"")
    (shared / "_index" / "gamma").mkdir()
    (shared / "_index" / "gamma" / cks["beta"].id).write_bytes(b"")
    with b.client() as c:
        r = c.restore("alpha")
        jobs_to_kill.append(int(r.pid))
        assert r.job.restored_from == cks["alpha"].id
        with pytest.raises(ClientError) as e:
            c.restore("gamma")
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        assert cks["beta"].id not in [k.id for k in c.list()]
    # nobody's "alpha" is its own: root's stored alpha is not adopted for it.
    assert call_as(NOBODY, b, "restore", "alpha")[0] == "NOT_FOUND"


def test_checkpoint_of_pid_1_the_daemon_or_its_ancestors_is_refused_before_criu(make_daemon, jobs_to_kill,
                                                                                  tmp_path):
    d = make_daemon("refuse").start()
    with d.client() as c:
        job = c.run(counter_argv(4))
        jobs_to_kill.append(int(job.pid))
        wait_for(lambda: len(ticks(job.log_path)) >= 2, 20)
        durable = c.checkpoint(job.id, wait_durable=True)
        assert durable.state == DURABLE and durable.in_tier
        before = sorted(p.name for p in (d.state / "work").iterdir())
        daemon_pid = d.proc.pid
        for target, says in [("1", "init"), ("2", "kernel thread"), (str(daemon_pid), "memsnapd itself"),
                             (str(os.getpid()), "ancestor of memsnapd")]:
            with pytest.raises(ClientError) as e:
                c.checkpoint(target, stop=True)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and says in e.value.message, e.value.message
        assert c.show(durable.id).in_tier  # nothing was evicted
        assert [k.id for k in c.list()] == [durable.id]  # no checkpoint was journaled
    assert sorted(p.name for p in (d.state / "work").iterdir()) == before  # CRIU never ran


def test_a_request_that_cannot_fit_evicts_nothing(make_daemon, jobs_to_kill, tmp_path):
    mnt = tmp_path / "tier"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        d = make_daemon("fit", tier=mnt).start()
        with d.client() as c:
            small = c.run(counter_argv(4))
            jobs_to_kill.append(int(small.pid))
            wait_for(lambda: len(ticks(small.log_path)) >= 2, 20)
            durable = c.checkpoint(small.id, wait_durable=True)
            big = c.run(counter_argv(64))
            jobs_to_kill.append(int(big.pid))
            wait_for(lambda: len(ticks(big.log_path)) >= 2, 30)
            with pytest.raises(ClientError) as e:
                c.checkpoint(big.id)
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert c.show(durable.id).in_tier
        d.cleanup()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _second(d: DaemonProc, **changes: str) -> subprocess.CompletedProcess[str]:
    args = d.args()
    for flag, value in changes.items():
        args[args.index(flag) + 1] = value
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run(args, capture_output=True, text=True, timeout=60, env=env)


def test_a_second_daemon_on_the_same_state_socket_or_port_exits_and_the_first_serves(make_daemon, tmp_path):
    token = tmp_path / "token"
    token.write_text("t" * 32)
    token.chmod(0o600)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    first = make_daemon("first", extra=["--listen", f"127.0.0.1:{port}", "--auth-token-file", str(token)]).start()
    other = tmp_path / "other"
    cases = {
        "state dir": {"--socket": str(other / "a.sock"), "--listen": "127.0.0.1:0"},
        "socket": {"--state-dir": str(other / "state-b"), "--listen": "127.0.0.1:0"},
        "port": {"--state-dir": str(other / "state-c"), "--socket": str(other / "c.sock")},
    }
    for what, changes in cases.items():
        r = _second(first, **changes)
        assert r.returncode != 0, (what, r.stdout, r.stderr)
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("memsnapd: ") and ("another " in last or "cannot listen" in last), (what, last)
        with first.client() as c:
            assert c.status(timeout=5).version, what
    assert Path(first.socket).exists()


def test_status_counts_and_the_tier_fs_are_daemon_wide_only_for_root(open_daemons, jobs_to_kill):
    d = open_daemons("status").start()
    with d.client() as c:
        job = c.run(counter_argv(4))
        jobs_to_kill.append(int(job.pid))
        wait_for(lambda: len(ticks(job.log_path)) >= 2, 20)
        c.checkpoint(job.id)
        root = c.status()
    assert root.checkpoints == 1 and root.jobs_running == 1
    theirs = call_as(NOBODY, d, "status")
    assert theirs[0] == "OK", theirs
    assert int(theirs[1].get("checkpoints", 0)) == 0 and int(theirs[1].get("jobs_running", 0)) == 0
    assert not theirs[1].get("checkpoints_by_state")
    assert "drain_queue_depth" not in theirs[1] or int(theirs[1]["drain_queue_depth"]) == 0
    assert root.tier_fs.startswith("a directory on tmpfs") and not theirs[1].get("tier_fs")


def test_bad_job_input_is_refused_at_the_edge(daemon):
    with daemon.client() as c:
        for argv, env, cwd in [(["/bin/true", "a\x00b"], {}, ""), (["/bin/true"], {"A=B": "1"}, ""),
                               (["/bin/true"], {"A": "x\x00y"}, ""), (["/bin/true"], {}, "/tmp\x00x"),
                               ([""], {}, ""), (["/bin/true"], {"": "1"}, "")]:
            with pytest.raises(ClientError) as e:
                c.run(argv, env=env, cwd=cwd)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, (argv, env, cwd)
        for target in ["²", "1" * 5000, "a b", "0:"]:
            with pytest.raises(ClientError) as e:
                c.checkpoint(target)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, target
            assert len(e.value.message) < 400
        assert c.status().version


def test_owner_uid_out_of_range_never_breaks_listing(daemon):
    import sqlite3

    db = sqlite3.connect(daemon.state / "catalog.db", timeout=30)
    db.execute("INSERT INTO checkpoints (id, state, pid, owner_uid, created_ms) "
               "VALUES ('ck-bad-uid', 'failed', 0, -1, 0)")
    db.commit()
    db.close()
    try:
        with daemon.client() as c:
            assert "ck-bad-uid" in [k.id for k in c.list()]
    finally:
        db = sqlite3.connect(daemon.state / "catalog.db", timeout=30)
        db.execute("DELETE FROM checkpoints WHERE id='ck-bad-uid'")
        db.commit()
        db.close()




def test_nobody_can_neither_see_nor_take_the_op_id_of_roots_restore(open_daemons, jobs_to_kill):
    # Progress (Status(op_id)) belongs to the caller that started the operation; op ids are per owner, so
    # nobody reusing root's op id sees nothing of root's restore and takes nothing from it.
    d = open_daemons("progress")
    d.env = {"MEMSNAP_FAILPOINTS": "slow-restore-10s"}  # root's restore stays in flight for 10 s
    d.start()
    op = "op-root-restore"
    with d.client() as c:
        job = c.run(counter_argv(8))
        jobs_to_kill.append(int(job.pid))
        wait_for(lambda: len(ticks(job.log_path)) >= 2, 20, what="the job to tick")
        ck = c.checkpoint(job.id, stop=True)
        done: list[object] = []
        t = threading.Thread(target=lambda: done.append(c.restore(ck.id, op_id=op, timeout=120)), daemon=True)
        t.start()
        wait_for(lambda: c.status(op_id=op).progress.kind == "restore", 20, what="root's restore to report progress")
        seen = call_as(NOBODY, d, "status", op_id=op)
        assert seen[0] == "OK" and "progress" not in seen[1], seen
        taken = call_as(NOBODY, d, "restore", ck.id, op_id=op)
        assert taken[0] in ("PERMISSION_DENIED", "NOT_FOUND"), taken
        assert c.status(op_id=op).progress.kind == "restore"  # root still follows its own restore
        t.join(120)
    assert done, "root's restore did not finish"
    jobs_to_kill.append(int(done[0].pid))  # type: ignore[attr-defined]
