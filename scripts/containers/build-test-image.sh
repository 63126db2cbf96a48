#!/usr/bin/env bash
# Builds the container test image localhost/memsnap-test:<hash of its sources> without a registry: Debian's
# static busybox and tests/workloads/memtick.c built static (the workload: random memory and a digest, and
# `memtick reap`, the init a checkpointed container runs its workload under). Prints the image's name.
set -euo pipefail
cd "$(dirname "$0")/../.."
src=tests/workloads/memtick.c
tag=$(cat "$src" "$0" | sha256sum | cut -c1-12)
image=localhost/memsnap-test:$tag
if ! podman image exists "$image"; then
  dir=$(mktemp -d)
  trap 'rm -rf "$dir"' EXIT
  mkdir -p "$dir"/rootfs/{bin,proc,sys,dev,etc,tmp,run}
  gcc -O2 -static -Wall -o "$dir/rootfs/memtick" "$src"
  cp /bin/busybox "$dir/rootfs/bin/busybox"
  for c in sh sleep cat ls ps; do ln -s busybox "$dir/rootfs/bin/$c"; done
  tar -C "$dir/rootfs" -c . | podman import --change 'CMD ["/memtick","reap"]' - "$image" >/dev/null
  echo "== build-test-image: built $image" >&2
fi
echo "$image"
