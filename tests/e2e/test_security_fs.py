"""Root never follows a path someone else controls (issue 13, items 1-4 and 8) and never restores an image
that is not the one asked for (issue 12, items 5 and 7). Real daemons, real CRIU, real files; where the attack
is a local user's, it runs as uid 65534. A store writer's attacks (another node's root on a shared store)
run as root here, since the store root is root's."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path

import grpc
import pytest

from memsnap.client import ClientError
from tests.helpers import NOBODY, REPO, DaemonProc, as_user_kwargs, counter_argv, restore_refused, ticks, wait_for

DURABLE = 4
# The attacker's snippets need only the standard library; the system interpreter is one that uid 65534 can
# run (the test's own may live under a 0700 /root).
SYSTEM_PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable


def run_as(uid: int, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Runs a standard-library Python snippet as uid."""
    return subprocess.run([SYSTEM_PYTHON, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          **as_user_kwargs(uid))


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A root-owned directory outside every memsnap root, whose contents and modes must never change."""
    v = tmp_path / "victim"
    v.mkdir(mode=0o755)
    (v / "precious").write_text("keep me")
    (v / "precious").chmod(0o640)
    (v / "sub").mkdir()
    (v / "sub" / "deep").write_text("keep me too")
    return v


def _snapshot(root: Path) -> dict[str, tuple[int, int, int, bytes]]:
    out = {}
    for p in sorted(root.rglob("*")):
        s = os.lstat(p)
        out[str(p.relative_to(root))] = (s.st_mode, s.st_uid, s.st_ctime_ns,
                                         p.read_bytes() if p.is_file() else b"")
    return out


def _job(d: DaemonProc, jobs_to_kill: list[int], mib: int = 8, name: str = "") -> tuple[str, int, str]:
    with d.client() as c:
        job = c.run(counter_argv(mib, 0.1), name=name)
    jobs_to_kill.append(int(job.pid))
    wait_for(lambda: len(ticks(job.log_path)) >= 2, 30, what="the job to tick")
    return job.id, int(job.pid), job.log_path


def _checkpoint(d: DaemonProc, target: str, *flags: str) -> dict:
    return json.loads(d.ctl("--json", "checkpoint", target, *flags, check=True).stdout)


def _running_jobs(d: DaemonProc) -> set[int]:
    with d.client() as c:
        return {int(j.pid) for j in c.jobs() if j.running}


def _start_refused(d: DaemonProc) -> subprocess.CompletedProcess[str]:
    """Runs memsnapd in the foreground; it must exit on its own, before serving."""
    d.base.mkdir(parents=True, exist_ok=True)
    return subprocess.run(d.args(), capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def _tier_path() -> Path:
    return Path(f"/dev/shm/memsnap-test-{uuid.uuid4().hex[:8]}")


# -- issue 13 item 1: delete never follows a symlinked checkpoint dir in the store --------------------------
def test_delete_of_a_symlinked_store_dir_removes_nothing_outside_and_reports_tampering(
        make_daemon, jobs_to_kill, victim):
    d = make_daemon("del").start()
    jid, _, _ = _job(d, jobs_to_kill)
    ck = _checkpoint(d, jid, "--wait", "durable")
    before = _snapshot(victim)
    # A store writer: mv store/<id> store/<id>.moved; ln -s /some/root/dir store/<id>
    os.rename(d.store / ck["id"], d.store / f"{ck['id']}.moved")
    os.symlink(victim, d.store / ck["id"])
    r = d.ctl("delete", ck["id"])
    assert r.returncode != 0 and "DATA_LOSS" in r.stderr and "tampered" in r.stderr
    assert _snapshot(victim) == before
    assert os.listdir(d.store / f"{ck['id']}.moved")  # nothing of the moved copy was removed either
    assert "store tampering" in d.log.read_text()


# -- issue 13 item 2: a drain never writes through a store dir swapped mid-drain ----------------------------
@pytest.mark.parametrize("swapped", ["packs", "checkpoint-dir"])
def test_store_dir_swapped_mid_drain_writes_nothing_outside_and_never_reports_durable(
        make_daemon, jobs_to_kill, victim, swapped):
    # packs: the drain writes its chunks into packs/<2 hex>/ (8 MiB packs here); checkpoint-dir: loose chunks,
    # whose small files go first into store/<id>/ (the bundle). Either dir is swapped for a link once the first
    # object landed in it (the 48 MiB of pages take seconds at 8 MB/s).
    loose = ["--pack-size", ""] if swapped == "checkpoint-dir" else ["--pack-size", "8M"]
    d = make_daemon("swap", extra=["--drain-bandwidth", "8M", "--compression-level", "0", *loose]).start()
    jid, _, _ = _job(d, jobs_to_kill, 48)
    before = _snapshot(victim)
    ck = _checkpoint(d, jid)
    sdir = d.store / ck["id"] if swapped == "checkpoint-dir" else d.store / "packs"
    wait_for(lambda: sdir.is_dir() and any(not p.name.startswith(".tmp-") for p in sdir.rglob("*") if p.is_file()),
             30, interval=0.005, what="the first object in the store")
    os.rename(sdir, sdir.with_name(sdir.name + ".moved"))
    os.symlink(victim, sdir)
    with d.client() as c:
        wait_for(lambda: c.show(ck["id"]).last_error, 60, what="the drain attempt to fail")
        info = c.show(ck["id"])
    assert info.state != DURABLE and not info.in_store
    assert "symbolic link" in info.last_error
    assert _snapshot(victim) == before
    d.stop(signal.SIGKILL)  # (it would retry for ever while the link is there)


def test_symlinked_index_entry_is_refused(make_daemon, jobs_to_kill, victim):
    d = make_daemon("index").start()
    before = _snapshot(victim)
    (d.store / "_index").mkdir(mode=0o700)
    os.symlink(victim, d.store / "_index" / "trainer")
    jid, _, _ = _job(d, jobs_to_kill, name="trainer")
    ck = _checkpoint(d, jid, "--wait", "durable")  # the copy is durable; only the hint is refused
    assert ck["state"] == "durable"
    assert _snapshot(victim) == before
    assert "store index entry for 'trainer' refused" in d.log.read_text()
    # Another node sharing the store and key never looks up the name through the link either.
    (victim / ck["id"]).write_text("")  # what the link would have led to
    before = _snapshot(victim)
    other = make_daemon("other", extra=["--store-dir", str(d.store), "--hmac-key-file",
                                        str(d.state / "hmac.key")]).start()
    r = restore_refused(other, "trainer", jobs_to_kill)
    assert r.returncode != 0 and "symbolic link" in r.stderr
    assert _running_jobs(other) == set()
    assert _snapshot(victim) == before


# -- issue 13 item 3: a tier someone else owns, or a symlinked tier path, is refused at start ---------------
def test_tier_precreated_by_nobody_refuses_start(make_daemon):
    d = make_daemon("owned", tier=_tier_path())
    run_as(NOBODY, "import os, sys; os.mkdir(sys.argv[1], 0o777); open(sys.argv[1] + '/mine', 'w').write('x')",
           str(d.tier)).check_returncode()
    before = _snapshot(d.tier), stat.S_IMODE(os.stat(d.tier).st_mode)
    r = _start_refused(d)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("memsnapd: memory tier") and "owned by uid 65534" in last and "remove it" in last
    assert (_snapshot(d.tier), stat.S_IMODE(os.stat(d.tier).st_mode)) == before  # no chmod, nothing emptied


def test_tier_path_that_is_a_symlink_refuses_start(make_daemon, victim):
    d = make_daemon("linked", tier=_tier_path())
    os.symlink(victim, d.tier)
    before = _snapshot(victim), stat.S_IMODE(os.stat(victim).st_mode)
    r = _start_refused(d)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("memsnapd: memory tier") and "symbolic link" in last
    assert (_snapshot(victim), stat.S_IMODE(os.stat(victim).st_mode)) == before
    d.tier.unlink()


@pytest.mark.parametrize("tier_owner", ["nobody", "root"])
def test_planted_staging_symlink_recovery_removes_nothing_outside(make_daemon, jobs_to_kill, victim, tier_owner):
    (victim / "ck-20260101-000000-abcdef").mkdir()  # named like a half-written image
    (victim / "ck-20260101-000000-abcdef" / "pages-1.img").write_text("keep")
    before = _snapshot(victim)
    d = make_daemon("staging", tier=_tier_path())
    if tier_owner == "nobody":
        run_as(NOBODY, "import os, sys; os.mkdir(sys.argv[1], 0o777); os.symlink(sys.argv[2], sys.argv[1] + "
               "'/.staging'); os.symlink(sys.argv[2], sys.argv[1] + '/.incoming')", str(d.tier),
               str(victim)).check_returncode()
        r = _start_refused(d)
        assert r.returncode != 0 and "owned by uid 65534" in r.stderr
    else:
        d.start()
        jid, _, _ = _job(d, jobs_to_kill)
        _checkpoint(d, jid)
        d.stop(signal.SIGKILL)
        shutil.rmtree(d.tier / ".staging")
        os.symlink(victim, d.tier / ".staging")
        os.symlink(victim, d.tier / "ck-20260101-000000-abcdef")  # a stray tier entry recovery removes
        d.start()
        assert (d.tier / ".staging").is_dir() and not (d.tier / ".staging").is_symlink()
        assert not os.path.lexists(d.tier / "ck-20260101-000000-abcdef")
    assert _snapshot(victim) == before


# -- issue 13 item 4: whoever races the staging dir gets nothing written, chmodded or signed -----------------
_ATTACKER = textwrap.dedent("""
    import os, select, sys
    tier, victim = sys.argv[1], sys.argv[2]
    staging = os.path.join(tier, ".staging")
    rounds = swaps = 0
    while rounds % 64 or not select.select([sys.stdin], [], [], 0)[0]:  # until the test says stop
        rounds += 1
        try:  # take .staging over when root's lies in a directory we own
            if os.stat(staging).st_uid != os.getuid():
                os.rename(staging, f"{staging}.{rounds}")
                os.mkdir(staging, 0o777)
            for name in os.listdir(staging):
                d = os.path.join(staging, name)
                if os.stat(d).st_uid == os.getuid():
                    continue
                mine = f"{d}.evil{rounds}"
                os.mkdir(mine, 0o777)
                with open(os.path.join(mine, "evil.img"), "w") as f:
                    f.write("attacker content")
                os.symlink(os.path.join(victim, "precious"), os.path.join(mine, "manifest.json"))
                os.symlink(os.path.join(victim, "sub", "deep"), os.path.join(mine, "inventory.img"))
                os.rename(d, f"{d}.orig{rounds}")
                os.rename(mine, d)
                swaps += 1
        except OSError:
            pass
        os.sched_yield()
    print(rounds, swaps)
""")


def test_racing_staging_swap_gets_nothing_outside_the_tier_and_nothing_signed(make_daemon, jobs_to_kill, victim):
    from memsnap import manifest

    d = make_daemon("race", tier=_tier_path())
    # As on main: the attacker creates the default tier before the daemon's first start.
    run_as(NOBODY, "import os, sys; os.mkdir(sys.argv[1], 0o777)", str(d.tier)).check_returncode()
    try:
        r = _start_refused(d)
        assert "owned by uid 65534" in r.stderr
        shutil.rmtree(d.tier)  # the operator follows the one-line advice, then starts again
    except subprocess.TimeoutExpired:
        pass  # (main served on the attacker's tier)
    d.start()
    jid, _, _ = _job(d, jobs_to_kill, 1)
    before = _snapshot(victim)
    attacker = subprocess.Popen([SYSTEM_PYTHON, "-c", _ATTACKER, str(d.tier), str(victim)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, **as_user_kwargs(NOBODY))
    key = (d.state / "hmac.key").read_bytes()
    made, failed, signed_evil = 0, [], []
    with d.client() as c:
        for _ in range(RACES):  # the attacker races every one of these dumps
            try:
                ckpt_id = c.checkpoint(jid).id
            except ClientError as exc:
                failed.append(exc)  # a dump spoiled by the attacker may fail; it must never succeed wrongly
                continue
            made += 1
            if "evil.img" in manifest.verify_dir(d.tier / ckpt_id, key).files:
                signed_evil.append(ckpt_id)
            c.delete(ckpt_id)  # (keeps the tier and store small)
    out, _ = attacker.communicate("stop\n", timeout=60)
    print(f"attacker: {out.strip()} (rounds, swaps); {made} checkpoints made, {len(failed)} failed")
    assert _snapshot(victim) == before
    assert signed_evil == []


RACES = 200


def test_criu_creates_images_unreadable_by_others(tmp_path):
    from memsnap.criu import Criu, DumpOptions

    images, work = tmp_path / "images", tmp_path / "work"
    images.mkdir(mode=0o755)
    work.mkdir()
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    old = os.umask(0o022)
    try:
        Criu().dump(proc.pid, images, work, DumpOptions(leave_running=True))
    finally:
        os.umask(old)
        proc.kill()
        proc.wait()
    made = list(images.iterdir())
    assert made and all(stat.S_IMODE(p.stat().st_mode) & 0o077 == 0 for p in made), \
        {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in made}


# -- issue 13 item 8: key hygiene ---------------------------------------------------------------------------
def test_stale_0644_hmac_tmp_still_gives_a_0600_key(make_daemon):
    d = make_daemon("key")
    d.state.mkdir(parents=True, mode=0o700)
    (d.state / "hmac.tmp").write_bytes(b"stale")
    (d.state / "hmac.tmp").chmod(0o644)
    d.start()
    assert stat.S_IMODE(os.stat(d.state / "hmac.key").st_mode) == 0o600


def test_hmac_key_readable_by_others_is_refused_at_start(make_daemon, tmp_path):
    key = tmp_path / "cluster.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o644)
    d = make_daemon("loosekey", extra=["--hmac-key-file", str(key)])
    r = _start_refused(d)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("memsnapd: HMAC key") and "chmod 600" in last


# -- issue 12 item 5: a swapped tier copy is never restored -------------------------------------------------
def test_swapped_tier_copy_gets_data_loss_and_no_process(make_daemon, jobs_to_kill):
    d = make_daemon("swapped").start()
    ja, _, _ = _job(d, jobs_to_kill)
    jb, _, log_b = _job(d, jobs_to_kill)
    a = _checkpoint(d, ja, "--stop")
    b = _checkpoint(d, jb, "--stop")
    shutil.rmtree(d.tier / a["id"])
    shutil.copytree(d.tier / b["id"], d.tier / a["id"])
    before = _running_jobs(d), len(ticks(log_b))
    r = restore_refused(d, a["id"], jobs_to_kill)
    assert r.returncode != 0 and "DATA_LOSS" in r.stderr and "swapped" in r.stderr
    assert (_running_jobs(d), len(ticks(log_b))) == before


# -- issue 12 item 7: concurrent restores of an evicted checkpoint ------------------------------------------
def test_concurrent_restores_of_an_evicted_checkpoint_then_a_later_restore_works(make_daemon, jobs_to_kill):
    d = make_daemon("concurrent").start()
    jid, _, log = _job(d, jobs_to_kill, 16)
    ck = _checkpoint(d, jid, "--stop", "--wait", "durable")
    d.ctl("evict", ck["id"], check=True)
    results: list[object] = []

    def restore() -> None:
        try:
            with d.client() as c:
                results.append(int(c.restore(ck["id"]).pid))
        except ClientError as exc:
            results.append(exc)

    threads = [threading.Thread(target=restore) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pids = [p for p in results if isinstance(p, int)]
    jobs_to_kill.extend(pids)
    failed = [e for e in results if isinstance(e, ClientError)]
    assert len(results) == 8 and pids
    assert all(e.code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) for e in failed), failed
    for pid in pids:
        wait_for(lambda pid=pid: ticks(log, pid), 30, what="every restored copy to tick")
        os.kill(pid, signal.SIGKILL)
    assert list((d.tier / ".staging").iterdir()) == []
    with d.client() as c:
        again = int(c.restore(ck["id"]).pid)
    jobs_to_kill.append(again)
    wait_for(lambda: ticks(log, again), 30, what="the later restore to tick")
