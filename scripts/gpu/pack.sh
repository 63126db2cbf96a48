#!/usr/bin/env bash
# Builds the one folder a GPU device run carries (default .gpu-carry/, at most 64 MiB):
#   bin/criu        a wrapper that runs bin/criu.real with lib/ as its only extra library path
#   bin/criu.real   the patched CRIU (scripts/install-criu.sh installs it at /usr/local/sbin/criu)
#   lib/            the shared libraries criu needs beyond glibc (ldd), which a CUDA image may lack
#   wheels/         memsnap's runtime deps for Python 3.12 x86_64 (scripts/gpu/wheels.txt)
#   MANIFEST        what is in it, with sizes
# Usage: scripts/gpu/pack.sh [DEST]   (env: MEMSNAP_CRIU, the criu to carry; PYTHON, the pip to use)
# memsnap itself travels as the working tree; scripts/gpu/run.sh uses this folder on the device.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DEST=${1:-$HERE/../../.gpu-carry}
CRIU=${MEMSNAP_CRIU:-/usr/local/sbin/criu}
PY=${PYTHON:-python3}
LIMIT=$((64 * 1024 * 1024))

log() { echo "pack.sh: $*" >&2; }
[ -x "$CRIU" ] || { log "no criu at $CRIU: run scripts/install-criu.sh (or set MEMSNAP_CRIU)"; exit 1; }

rm -rf "$DEST"
mkdir -p "$DEST/bin" "$DEST/lib" "$DEST/wheels"

# 1. CRIU and every library it loads except glibc's own (those stay the device's).
cp "$CRIU" "$DEST/bin/criu.real"
ldd "$CRIU" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
        libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*|ld-linux*|libresolv.so.*) ;;
        *) cp -L "$lib" "$DEST/lib/" ;;
    esac
done
cat > "$DEST/bin/criu" <<'WRAP'
#!/bin/sh
# The carried CRIU with its carried libraries; nothing else sees them (no global LD_LIBRARY_PATH).
d=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$d/../lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$d/criu.real" "$@"
WRAP
chmod 755 "$DEST/bin/criu" "$DEST/bin/criu.real"
"$DEST/bin/criu" --version >/dev/null || { log "the carried criu does not start here"; exit 1; }

# 2. Wheels for the device's Python (3.12, x86_64, glibc): binary only, each pinned, no deps.
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform any \
    -d "$DEST/wheels" -r "$HERE/wheels.txt"

# 3. What is in it, and the size check.
( cd "$DEST" && find . -type f -printf '%s\t%p\n' | sort -k2 ) > "$DEST/MANIFEST"
size=$(du -sb "$DEST" | cut -f1)
log "$DEST: $(find "$DEST" -type f | wc -l) files, $size bytes (limit $LIMIT)"
if [ "$size" -gt "$LIMIT" ]; then
    log "too big for the device's 64 MiB carry limit"
    exit 1
fi
