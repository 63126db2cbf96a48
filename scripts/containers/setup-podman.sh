#!/usr/bin/env bash
# Podman for memsnap's container tests (issue 33), from Debian, plus the test image (build-test-image.sh).
#
# What this VM needs, measured: podman 4.3.1 runs containers with runc (crun refuses the hybrid cgroup layout),
# with cgroupfs (no systemd as PID 1) and file events, and after lowering the default nofile/nproc limits (the
# defaults are above what root may set here). No registry is reachable: the test image is built locally.
set -euo pipefail
cd "$(dirname "$0")/../.."
log() { echo "== setup-podman: $*" >&2; }

pkgs=(podman runc conmon busybox-static containernetworking-plugins gcc libc6-dev)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

conf=/etc/containers/containers.conf
if [ ! -e "$conf" ] || grep -q '^# memsnap test settings' "$conf"; then
  mkdir -p /etc/containers
  cat > "$conf" <<'CONF'
# memsnap test settings (scripts/containers/setup-podman.sh); delete this file to get podman's defaults back.
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
else
  log "$conf exists and is not ours: left as it is"
fi
scripts/containers/build-test-image.sh
