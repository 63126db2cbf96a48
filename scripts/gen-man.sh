#!/usr/bin/env bash
# Regenerates docs/memsnapctl.1 from memsnapctl's own command tree (never hand-edit it).
# View it with: man ./docs/memsnapctl.1
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONPATH=$PWD python3 scripts/gen_man.py > "${1:-docs/memsnapctl.1}"
