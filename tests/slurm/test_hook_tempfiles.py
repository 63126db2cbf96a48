"""The Slurm hooks run as root: they never write through a name another user could plant first.

These run the real scripts/slurm/prolog.sh and epilog.sh against a dead socket (no cluster needed):
the prolog then has memsnapctl's complaint to report, which is exactly what it once wrote to
$TMPDIR/memsnap-prolog.<pid>.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.helpers import REPO
from tests.slurm.slurmtools import hook_env

PROLOG = REPO / "scripts" / "slurm" / "prolog.sh"
EPILOG = REPO / "scripts" / "slurm" / "epilog.sh"


def _plant(tmpdir: Path, target: Path, n: int = 400) -> None:
    """Symlinks at the predictable names of the next n pids, all pointing at target."""
    nxt = int(Path("/proc/sys/kernel/ns_last_pid").read_text())
    for pid in range(nxt + 1, nxt + n):
        for stem in ("memsnap-prolog", "memsnap-epilog"):
            (tmpdir / f"{stem}.{pid}").symlink_to(target)


def test_prolog_and_epilog_never_write_through_planted_symlinks(tmp_path):
    planted = tmp_path / "public-tmp"
    planted.mkdir()
    planted.chmod(0o1777)
    target = tmp_path / "precious"
    target.write_text("root's file\n")
    _plant(planted, target)
    env = {**hook_env(str(tmp_path / "dead.sock"), tmp_path, "4242"), "TMPDIR": str(planted),
           "MEMSNAP_PROLOG_START_WAIT": "1"}
    for hook in (PROLOG, EPILOG):
        r = subprocess.run([str(hook)], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (hook.name, r.stderr)
    assert target.read_text() == "root's file\n"
    assert all(p.is_symlink() for p in planted.iterdir())  # nothing planted was replaced or removed either
    log = (tmp_path / "hooks.log").read_text()
    assert "memsnapd does not answer: " in log and "no reason given" not in log, log
    assert os.stat(target).st_mode & 0o777 == 0o644
