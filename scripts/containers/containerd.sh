#!/usr/bin/env bash
# A containerd with its CRI plugin for memsnap's pod tests (issue 33), started by the tests themselves (this VM has no
# systemd as PID 1): everything under DIR, its socket DIR/containerd.sock, the test image imported, CNI bridge
# networking of its own (cni-memsnap0, 10.89.0.0/24).
#   scripts/containers/containerd.sh install     apt packages (containerd, CNI plugins); setup.sh --test runs it
#   scripts/containers/containerd.sh start DIR   start it (pid in DIR/containerd.pid), import the image, wait for CRI
#   scripts/containers/containerd.sh stop DIR    stop it, remove its pods and mounts
set -euo pipefail
cd "$(dirname "$0")/../.."
log() { echo "== containerd.sh: $*" >&2; }

case "${1:-}" in
install)
  missing=()
  for p in containerd containernetworking-plugins; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  ;;
start)
  dir=$(realpath -m "$2")
  mkdir -p "$dir"/{root,state,cni}
  image=$(scripts/containers/build-test-image.sh)
  cat > "$dir/cni/10-memsnap.conflist" <<CNI
{"cniVersion": "0.4.0", "name": "memsnap-pods", "plugins": [
  {"type": "bridge", "bridge": "cni-memsnap0", "isGateway": true, "ipMasq": false,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.89.0.0/24"}]], "dataDir": "$dir/ipam"}}]}
CNI
  cat > "$dir/config.toml" <<TOML
version = 2
root = "$dir/root"
state = "$dir/state"
[grpc]
  address = "$dir/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$image"
  # this VM's root lacks CAP_SYS_RESOURCE: it cannot lower oom_score_adj (to -998 for sandboxes)
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$dir/cni"
TOML
  containerd --config "$dir/config.toml" > "$dir/containerd.log" 2>&1 &
  echo $! > "$dir/containerd.pid"
  for _ in $(seq 100); do [ -S "$dir/containerd.sock" ] && break; sleep 0.1; done
  podman save --format docker-archive "$image" 2>/dev/null | ctr --address "$dir/containerd.sock" -n k8s.io images import - >/dev/null
  echo "$image"
  ;;
stop)
  dir=$(realpath -m "$2")
  if [ -f "$dir/containerd.pid" ]; then
    pid=$(cat "$dir/containerd.pid")
    export CONTAINER_RUNTIME_ENDPOINT="unix://$dir/containerd.sock"
    for t in $(ctr --address "$dir/containerd.sock" -n k8s.io tasks ls -q 2>/dev/null); do
      ctr --address "$dir/containerd.sock" -n k8s.io tasks kill -s KILL "$t" >/dev/null 2>&1 || true
    done
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    pkill -f "containerd-shim-runc-v2 .*-address $dir/containerd.sock" 2>/dev/null || true
  fi
  { grep " $dir/" /proc/self/mountinfo || true; } | awk '{print $5}' | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
  ip link del cni-memsnap0 2>/dev/null || true
  ;;
*) echo "usage: $0 install | start DIR | stop DIR" >&2; exit 2 ;;
esac
