"""memsnapd's start (a restart after a crash, or by systemd) pays only for the imports every node uses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_memsnapd_imports_neither_boto3_numpy_nor_pyroute2_before_it_needs_them() -> None:
    code = ("import sys\nimport memsnap.daemon\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'boto3', 'botocore', 'numpy', 'pyroute2'}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.stdout.strip() == "[]", r.stdout + r.stderr


def test_the_store_package_still_gives_s3store() -> None:
    from memsnap.store import S3Store
    from memsnap.store.s3 import S3Store as Direct

    assert S3Store is Direct
