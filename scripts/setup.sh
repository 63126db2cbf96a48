#!/usr/bin/env bash
# Sets up a node for memsnap, idempotently: system packages, CRIU >= 4.1, the Python package.
#   scripts/setup.sh           node setup (what the demo needs)
#   scripts/setup.sh --test    also the test dependencies (pytest, moto, torch CPU) and the one-node Slurm
# Run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[ "${1:-}" = "--test" ] && want_test=1
[ "$(id -u)" = 0 ] || { echo "setup.sh: run as root (CRIU needs it)" >&2; exit 1; }

log() { printf '== %s\n' "$*"; }

# System packages: util-linux (unshare/setsid), iproute2 + iptables/nftables (network lock, netns tests),
# systemd (systemd-analyze for verifying the unit), and the Python venv/headers for wheels that compile.
pkgs=(util-linux iproute2 iptables nftables systemd procps psmisc curl ca-certificates xz-utils)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

log "CRIU"
scripts/install-criu.sh

# A lazy move's page server (CRIU) sizes its pipes to ~3.2 MiB: that needs CAP_SYS_RESOURCE, or a
# pipe-max-size at least that big. Some VMs and containers give root no CAP_SYS_RESOURCE.
cap_eff=$(awk '/^CapEff:/ { print $2 }' /proc/self/status)
if (( (16#$cap_eff >> 24 & 1) == 0 )) && [ "$(cat /proc/sys/fs/pipe-max-size)" -lt 4194304 ]; then
  log "no CAP_SYS_RESOURCE here: raising fs.pipe-max-size to 4 MiB for lazy moves"
  sysctl -q -w fs.pipe-max-size=4194304
fi

PY=${PYTHON:-python3}
extras="."
[ $want_test = 1 ] && extras=".[test]"
log "Python package ($extras)"
$PY -m pip install -q --disable-pip-version-check -e "$extras" 2>&1 | grep -v "Running pip as the 'root' user" || true

if [ $want_test = 1 ]; then
  # Real programs the tests and the soak run under memsnap (tests/e2e/test_busy_servers.py, tests/soak).
  real=(redis-server redis-tools memcached nginx-light wrk apache2-utils sqlite3 default-jdk-headless curl)
  missing=()
  for p in "${real[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]} (real programs for the tests)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
  if ! $PY -c 'import torch' 2>/dev/null; then
    # The CPU build: on this machine kind pip takes it from a local file (no multi-GB CUDA download).
    log "PyTorch CPU (for the real-workload test)"
    $PY -m pip install -q --disable-pip-version-check 'torch==2.13.0' 2>&1 | grep -v "Running pip as" || true
  fi
  log "podman and the container test image (tests/e2e/test_containers.py)"
  scripts/containers/setup-podman.sh >/dev/null
  scripts/containers/containerd.sh install  # (tests/e2e/test_containers_cri.py starts its own containerd)
  log "one-node Slurm"
  scripts/slurm/setup-test-cluster.sh
fi
log "setup done"
