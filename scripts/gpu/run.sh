#!/usr/bin/env bash
# Runs tests/gpu on a GPU machine that has the NVIDIA driver and PyTorch but no CRIU, no memsnap
# dependencies and no registry, using the folder scripts/gpu/pack.sh built (default .gpu-carry/).
# Writes into $OUT (default /tmp/memsnap-gpu-out): gpu.json (the numbers), junit.xml, pytest.log,
# node.txt (driver, nvidia-smi, criu check), memsnapd.log, logs.tgz (CRIU logs): at most 8 files.
# Exits 0 with gpu.json saying "skipped" where there is no NVIDIA GPU.
#
# Env: MEMSNAP_GPU_CARRY (the packed folder), MEMSNAP_GPU_BUDGET_S (seconds the tests may take,
# default 300; bigger sizes are skipped when they would not fit), MEMSNAP_GPU_BENCH_GIB (1,8,32).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO" || exit 1
CARRY=${MEMSNAP_GPU_CARRY:-$REPO/.gpu-carry}
OUT=${OUT:-/tmp/memsnap-gpu-out}
mkdir -p "$OUT"
START=$(date +%s)
BUDGET=${MEMSNAP_GPU_BUDGET_S:-300}
export MEMSNAP_GPU_DEADLINE=$((START + BUDGET)) MEMSNAP_GPU_RESULTS="$OUT"
NODE="$OUT/node.txt"
log() { echo "[run.sh +$(( $(date +%s) - START ))s] $*" | tee -a "$NODE"; }

log "kernel $(uname -r), $(python3 --version 2>&1), uid $(id -u), repo $REPO"
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    log "no NVIDIA GPU here (nvidia-smi missing or listing none): nothing to run"
    echo '{"skipped": "no NVIDIA GPU on this node"}' > "$OUT/gpu.json"
    exit 0
fi
{ nvidia-smi; nvidia-smi -q | grep -iE 'driver version|cuda version|persistence|mig mode' | sort -u
  cat /proc/driver/nvidia/version 2>/dev/null; } >> "$NODE" 2>&1
log "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -n1)"
log "memory: $(grep -E 'MemTotal|MemAvailable' /proc/meminfo | tr -s ' ' | tr '\n' ' '); /dev/shm: $(df -h /dev/shm | tail -n1)"

# The memory tier is /dev/shm: make sure it is a tmpfs big enough for a 32 GiB image (size is a limit,
# not an allocation).
if ! mountpoint -q /dev/shm 2>/dev/null; then
    mkdir -p /dev/shm && mount -t tmpfs -o size=90% tmpfs /dev/shm 2>&1 | tee -a "$NODE"
elif [ "$(df -k --output=size /dev/shm | tail -n1)" -lt $(( $(awk '/^MemTotal/ {print $2}' /proc/meminfo) * 9 / 10 )) ]; then
    mount -o remount,size=90% /dev/shm 2>&1 | tee -a "$NODE"  # only ever grows it
fi
log "/dev/shm now: $(df -h /dev/shm | tail -n1)"

# memsnap's deps, into a temp site dir ahead of the image's own packages.
SITE=$(mktemp -d /tmp/memsnap-site.XXXXXX)
trap 'rm -rf "$SITE"' EXIT
if compgen -G "$CARRY/wheels/*.whl" >/dev/null; then
    if ! python3 -m pip --version >/dev/null 2>&1; then
        log "no pip here: unpacking the wheels as they are"
        python3 -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
            "$SITE" "$CARRY"/wheels/*.whl 2>&1 | tee -a "$NODE"
    elif ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
            --target "$SITE" "$CARRY"/wheels/*.whl >>"$NODE" 2>&1; then
        log "pip refused the wheels (see node.txt; not this Python?): using the image's packages"
    fi
else
    log "no wheels in $CARRY/wheels: using the image's packages"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
python3 - <<'PY' 2>&1 | tee -a "$NODE"
import importlib
for name in ("grpc", "google.protobuf", "grpc_health", "grpc_reflection", "psutil", "pyroute2", "click",
             "zstandard", "blake3", "prometheus_client", "boto3", "torch"):
    try:
        m = importlib.import_module(name)
        print(f"import {name}: {getattr(m, '__version__', '?')} {getattr(m, '__file__', '')}")
    except Exception as exc:  # report and go on: the tests say what it breaks
        print(f"import {name}: FAILED {exc!r}")
PY

# The carried CRIU (its wrapper adds only its own libraries); `criu check` first, for the record.
mkdir -p /run 2>/dev/null
chmod 755 "$CARRY"/bin/* 2>/dev/null  # in case the copy to this machine lost the modes
if [ -x "$CARRY/bin/criu" ] && "$CARRY/bin/criu" --version >>"$NODE" 2>&1; then
    export MEMSNAP_CRIU="$CARRY/bin/criu" PATH="$CARRY/bin:$PATH"
    log "criu: $("$MEMSNAP_CRIU" --version | head -n1); criu check:"
    timeout 60 "$MEMSNAP_CRIU" check 2>&1 | tail -n 20 | tee -a "$NODE"
    timeout 60 "$MEMSNAP_CRIU" check --feature list 2>&1 | tail -n 3 >>"$NODE"
elif command -v criu >/dev/null 2>&1; then
    log "no carried criu that starts; using $(command -v criu)"
    export MEMSNAP_CRIU=$(command -v criu)
else
    log "no criu that starts here: the tests that need CRIU will be skipped"
    ldd "$CARRY/bin/criu.real" 2>&1 | grep -i 'not found' | tee -a "$NODE"
    export MEMSNAP_CRIU=/nonexistent/criu
fi

# The tests: pytest's own temp dir outside the checkout, no cache, no bytecode.
BASE=/tmp/memsnap-gpu-pytest
rm -rf "$BASE"
log "running tests/gpu (budget ${BUDGET}s, sizes ${MEMSNAP_GPU_BENCH_GIB:-1,8,32} GiB)"
timeout --kill-after=20 $((BUDGET + 90)) python3 -m pytest tests/gpu -v -rs -p no:cacheprovider \
    --basetemp="$BASE" --junitxml="$OUT/junit.xml" -o junit_family=xunit2 2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
log "pytest exit status $rc"
find "$BASE" -name '*.log' -size -20M 2>/dev/null | tar czf "$OUT/logs.tgz" -T - 2>/dev/null
if [ "$(stat -c %s "$OUT/logs.tgz" 2>/dev/null || echo 0)" -gt $((15 * 1024 * 1024)) ]; then
    # Too big to come back: keep each log's last 400 lines only.
    TAILS=$(mktemp -d /tmp/memsnap-logtails.XXXXXX)
    find "$BASE" -name '*.log' | while read -r f; do
        mkdir -p "$TAILS$(dirname "$f")"; tail -n 400 "$f" > "$TAILS$f"; done
    tar czf "$OUT/logs.tgz" -C "$TAILS" . 2>/dev/null
fi
python3 - "$OUT/gpu.json" <<'PY' 2>&1 | tee -a "$NODE"
import json, sys
try:
    print(json.dumps(json.load(open(sys.argv[1])), indent=1)[:6000])
except Exception as exc:
    print(f"no gpu.json: {exc!r}")
PY
log "done"
exit "$rc"
