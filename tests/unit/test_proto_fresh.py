"""The generated protobuf code in memsnap/v1, memsnap/criurpc and memsnap/criapi matches proto/ (never hand-edited)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    subprocess.run([str(REPO / "scripts" / "gen-proto.sh"), str(tmp_path)], check=True, cwd=REPO)
    stale = []
    for sub in ("memsnap/v1", "memsnap/criurpc", "memsnap/criapi"):
        for new in (tmp_path / sub).iterdir():
            old = REPO / sub / new.name
            if not old.exists() or _code(old) != _code(new):
                stale.append(f"{sub}/{new.name}")
    assert not stale, f"stale generated code {stale}: run scripts/gen-proto.sh and commit the result"


# The grpcio-tools patch release that generated a *_grpc.py is stamped into it (the oldest grpcio it imports
# with); the package index moves on (1.85.1 -> 1.85.4) without the code changing.
_STAMP = re.compile(rb"^GRPC_GENERATED_VERSION = '[0-9.]+'$", re.MULTILINE)


def _code(path: Path) -> bytes:
    return _STAMP.sub(b"GRPC_GENERATED_VERSION = ...", path.read_bytes())


def test_the_generated_grpc_code_imports_with_the_grpcio_installed() -> None:
    import memsnap.criapi.cri_api_pb2_grpc  # noqa: F401
    import memsnap.v1.memsnap_pb2_grpc  # noqa: F401
    import memsnap.v1.peer_pb2_grpc  # noqa: F401  (each raises RuntimeError where grpcio is older than its stamp)
