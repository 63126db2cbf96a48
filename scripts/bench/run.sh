#!/usr/bin/env bash
# memsnap benchmark, one command (as root): scripts/bench/run.sh [--quick] [bench.py options]
#   full run (~30 min): bench/results/bench.{json,md,png}     --quick (~5 min): bench/results/tmp/quick.*
# Needs CRIU (scripts/install-criu.sh), sshfs + openssh-server + iproute2 (installed here if missing),
# and the bench extra (matplotlib). Cleans up its network namespace, mounts and daemon on exit.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ "$(id -u)" = 0 ] || { echo "run as root: CRIU, network namespaces and tc need it" >&2; exit 1; }
if ! command -v sshfs >/dev/null || [ ! -x /usr/sbin/sshd ] || ! command -v tc >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq sshfs openssh-server iproute2 >/dev/null
fi
python3 -c "import matplotlib, psutil" 2>/dev/null || python3 -m pip install -q -e '.[bench]'
exec python3 scripts/bench/bench.py "$@"
