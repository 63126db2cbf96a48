#!/usr/bin/env bash
# Runs the tests.
#   scripts/test.sh            the whole suite: real CRIU, real Slurm, a local S3 server. Run as root. Sets up what
#                              it needs first (idempotent), so it also works on a fresh machine. The unit tier runs
#                              as uid 65534 (it needs no privilege), everything else as root.
#   scripts/test.sh --fast     the unit tier alone (tests/unit: pure logic and the seams, no CRIU, no root; about
#                              a minute). As root it drops to uid 65534 first. Needs the package and its test
#                              extras installed (scripts/setup.sh --test, or pip install -e '.[test]').
# Arguments after these go to pytest (with arguments, the whole suite runs in one pytest, as root).
set -euo pipefail
cd "$(dirname "$0")/.."
scratch=""
PY=${PYTHON:-python3}
NOBODY=65534

# pytest exits 5 when it collected nothing: that is a failure, not a pass.
pytest_rc() { [ "$1" = 5 ] && { echo "test.sh: no tests ran" >&2; return 1; }; return "$1"; }

# The unit tier as uid 65534. Its Python may sit where that uid cannot reach (pyenv under a 0700 /root): then a
# private mount namespace shows it at a path it can, and the interpreter and its libpython are run from there.
unit_as_nobody() {
  local prefix py libdir
  scratch=$(mktemp -d /tmp/memsnap-unit.XXXXXX)
  trap 'rm -rf "$scratch"' EXIT  # (by root: what the tests left there is 65534's)
  chown "$NOBODY:$NOBODY" "$scratch"
  chmod 0700 "$scratch"
  mkdir "$scratch/py"
  chown root:root "$scratch/py"
  prefix=$("$PY" -c 'import sys; print(sys.prefix if sys.prefix == sys.base_prefix else "")')
  py=$("$PY" -c 'import sys; print(sys.executable)')
  local as_nobody=(setpriv --reuid "$NOBODY" --regid "$NOBODY" --clear-groups)
  if ! "${as_nobody[@]}" test -r tests/unit/test_lint.py; then
    echo "test.sh: uid $NOBODY cannot read $(pwd): put the checkout where others may read it" >&2
    return 1
  fi
  local bind=""
  if ! "${as_nobody[@]}" "$py" -c 'import pytest, memsnap' >/dev/null 2>&1; then
    [ -n "$prefix" ] || { echo "test.sh: uid $NOBODY cannot run $py (a virtualenv it cannot reach)" >&2; return 1; }
    bind="mount --bind '$prefix' '$scratch/py' && "
    py="$scratch/py/bin/$(basename "$py")"
    libdir="$scratch/py/lib"
  fi
  local env=(env -i HOME="$scratch" PATH="$(dirname "$py"):/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
             LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1 MYPY_CACHE_DIR="$scratch/mypy" RUFF_CACHE_DIR="$scratch/ruff"
             GIT_CONFIG_COUNT=1 GIT_CONFIG_KEY_0=safe.directory GIT_CONFIG_VALUE_0="$(pwd)"
             ${libdir:+LD_LIBRARY_PATH="$libdir"})
  local rc=0
  # shellcheck disable=SC2016
  unshare -m --propagation private sh -c "$bind"'exec "$@"' sh "${as_nobody[@]}" "${env[@]}" \
    "$py" -m pytest tests/unit -q -p no:cacheprovider --basetemp "$scratch/tmp" "$@" || rc=$?
  pytest_rc "$rc"
}

if [ "${1:-}" = --fast ]; then
  shift
  if [ "$(id -u)" = 0 ]; then
    unit_as_nobody "$@"
  else
    rc=0; "$PY" -m pytest tests/unit -q -p no:cacheprovider "$@" || rc=$?
    pytest_rc "$rc"
  fi
  exit
fi

scripts/setup.sh --test
# The root tier starts memsnapd a few hundred times, and each start compiled its ~150 modules again where the
# environment sets PYTHONDONTWRITEBYTECODE (this VM's does): 0.25 s a start. Bytecode goes to a cache of this
# run's own instead, outside the checkout (which stays clean), made by root 0700: nobody else can plant a .pyc
# that a root daemon would load.
pyc=$(mktemp -d /var/tmp/memsnap-pyc.XXXXXX)
trap 'rm -rf "$pyc"' EXIT
export PYTHONPYCACHEPREFIX="$pyc"
unset PYTHONDONTWRITEBYTECODE
if [ $# -gt 0 ]; then
  rc=0; $PY -m pytest tests -q -rs "$@" || rc=$?
  pytest_rc "$rc"
  exit
fi
# The unit tier (CPU-bound, ~2 min) runs beside the root tier (which mostly waits on daemons, CRIU and jobs: about
# half a core of two); its report follows the root tier's.
unit_log=$(mktemp /tmp/memsnap-unit-log.XXXXXX)
(unit_as_nobody -rs -m "not root" >"$unit_log" 2>&1) &
unit_pid=$!
echo "== everything else, as root (and the unit tests that need root), beside the unit tier as uid $NOBODY"
rest=0; $PY -m pytest tests -q -rs --durations=25 -m "root or not unit" || rest=$?
unit=0; wait "$unit_pid" || unit=$?
echo "== the unit tier, as uid $NOBODY"
cat "$unit_log"
rm -f "$unit_log"
pytest_rc "$rest" || exit 1
exit "$unit"
