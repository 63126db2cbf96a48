#!/usr/bin/env bash
# Runs the whole test suite: real CRIU, real Slurm, a local S3 server. Run as root.
# Sets up what it needs first (idempotent), so it also works on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
PY=${PYTHON:-python3}
set +e
$PY -m pytest tests -q -rs "$@"
rc=$?
set -e
# pytest exits 5 when it collected nothing: that is a failure, not a pass.
[ $rc = 5 ] && { echo "test.sh: no tests ran" >&2; exit 1; }
exit $rc
