"""The generated protobuf code in memsnap/v1, memsnap/criurpc and memsnap/criapi matches proto/ (never hand-edited)."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    subprocess.run([str(REPO / "scripts" / "gen-proto.sh"), str(tmp_path)], check=True, cwd=REPO)
    stale = []
    for sub in ("memsnap/v1", "memsnap/criurpc", "memsnap/criapi"):
        for new in (tmp_path / sub).iterdir():
            old = REPO / sub / new.name
            if not old.exists() or old.read_bytes() != new.read_bytes():
                stale.append(f"{sub}/{new.name}")
    assert not stale, f"stale generated code {stale}: run scripts/gen-proto.sh and commit the result"
