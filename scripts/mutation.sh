#!/usr/bin/env bash
# Mutation testing (mutmut 3) of the modules that guard safety, against the fast unit tests.
#
#   scripts/mutation.sh                 # every target below, report in bench/results/mutation.txt
#   scripts/mutation.sh 'memsnap.manifest.*'   # only mutants whose name matches (mutmut's globs)
#   MUTATION_CHILDREN=4 scripts/mutation.sh    # parallel workers (default: 2)
#
# Runs in a scratch copy of the checkout (mutmut writes mutants/ and a setup.cfg there), so the
# checkout is never touched. Needs `pip install -e .[test]` (mutmut is in the test extras); no root, no
# CRIU, no daemon. Not in CI: about 22 min of mutants plus 3 min of diffs on two shared cores
# (docs/mutation.md). As root it runs the mutants in their own PID namespace (see below).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${MUTATION_REPORT:-$repo/bench/results/mutation.txt}
work=$(mktemp -d /tmp/memsnap-mutation.XXXXXX)
[[ -n ${MUTATION_KEEP:-} ]] && echo "scratch copy kept in $work" >&2 || trap 'rm -rf "$work"' EXIT
cd "$repo"
git ls-files -co --exclude-standard -z | grep -zv '^bench/\|^docs/' | xargs -0 cp --parents -t "$work"
cd "$work"

# What guards safety: manifest verification, authorization, name resolution, recovery, store paths.
# (remote.py may be named auth.py after the redesign; whichever exists is mutated.)
targets=(memsnap/manifest.py memsnap/safefs.py memsnap/store/posix.py memsnap/validate.py memsnap/engine.py)
for f in memsnap/remote.py memsnap/auth.py; do [[ -f $f ]] && targets+=("$f"); done
tests=(tests/unit/test_manifest.py tests/unit/test_safefs.py tests/unit/test_remote_auth.py
       tests/unit/test_validate.py tests/unit/test_engine_guards.py tests/unit/test_auth_interceptor.py
       tests/unit/test_engine_recover.py tests/unit/test_posix_store.py tests/unit/test_safefs_decisions.py
       tests/unit/test_auth_setup.py tests/unit/test_auth_tls.py tests/unit/test_manifest_format.py)
existing=(); for t in "${tests[@]}"; do [[ -f $t ]] && existing+=("$t"); done
# test_store.py's POSIX tests (its S3 ones need a moto server and test nothing mutated here).
for t in $(grep -o '^def test_posix_[a-z_0-9]*' tests/unit/test_store.py | cut -c5-); do
  existing+=("tests/unit/test_store.py::$t")
done
# A mutant may signal the wrong process: recover's kill_tree(rec.pid) with another row's pid, or
# kill_tree(None), which psutil reads as "this process". As root that can reach every process of the
# machine (a tree rooted at pid 1). So the mutants run in their own PID namespace, where pid 1 is a
# shell above mutmut and nothing outside can be signalled; as non-root they can only reach this user's processes.
isolate=()
if [[ $(id -u) -eq 0 ]] && unshare --pid --fork --mount-proc --kill-child true 2>/dev/null; then
  # (bash stays the namespace's init, reaping orphans that would otherwise reach mutmut's wait())
  isolate=(unshare --pid --fork --mount-proc --kill-child bash -c '"$@"; exit $?' mutation-init)
elif [[ $(id -u) -eq 0 ]]; then
  echo "mutation.sh: as root the mutants need a PID namespace (unshare --pid); refusing to run without" >&2
  exit 1
fi
{
  echo "[mutmut]"
  echo "source_paths=memsnap"
  echo "only_mutate="; for t in "${targets[@]}"; do echo "    $t"; done
  echo "pytest_add_cli_args_test_selection="; for t in "${existing[@]}"; do echo "    $t"; done
  echo "timeout_multiplier=${MUTATION_TIMEOUT_MULTIPLIER:-5}"
  echo "pytest_add_cli_args="
  echo "    -p no:cacheprovider"
  echo "    -q"
  if [[ ${#isolate[@]} -gt 0 ]]; then  # (no kernel thread is visible inside the namespace)
    echo "    --deselect"
    echo "    tests/unit/test_engine_guards.py::test_init_and_kernel_threads_are_refused[2-kernel thread]"
  fi
} > setup.cfg

# In engine.py only the functions that decide who may do what to which checkpoint are mutated.
patterns=("$@")
if [[ ${#patterns[@]} -eq 0 ]]; then
  patterns=('memsnap.manifest.*' 'memsnap.safefs.*' 'memsnap.store.posix.*' 'memsnap.validate.*'
            'memsnap.remote.*' 'memsnap.auth.*'
            'memsnap.engine.*resolve_pid__*' 'memsnap.engine.*_job_by_name__*'
            'memsnap.engine.*latest_restorable__*' 'memsnap.engine.*_authorize_uid__*'
            'memsnap.engine.*ǁrecover__*')
fi
start=$(date +%s)
"${isolate[@]}" mutmut run --max-children "${MUTATION_CHILDREN:-2}" "${patterns[@]}" > run.log 2>&1 || true
secs=$(( $(date +%s) - start ))
mutmut results --all true > results.txt 2>&1 || mutmut results > results.txt 2>&1 || true
mkdir -p "$(dirname "$out")"
{
  echo "# mutmut $(mutmut --version 2>/dev/null | awk '{print $NF}') over: ${targets[*]}"
  echo "# tests: ${existing[*]}"
  echo "# patterns: ${patterns[*]}"
  echo "# wall time: ${secs}s with ${MUTATION_CHILDREN:-2} workers on $(nproc) cores, $(date -u +%FT%TZ)"
  tail -n 3 run.log | tr '\r' '\n' | tail -n 2
  sel=$(grep -E ': (survived|timeout|suspicious|segfault|no tests)' results.txt | sed 's/^ *//' || true)
  echo "# killed: $(grep -c ': killed$' results.txt || true)"
  echo "# survived: $(grep -c ': survived$' results.txt || true)"
  echo "# timeout (the tests hung: counted as killed): $(grep -c ': timeout$' results.txt || true)"
  echo "# no tests (no selected test runs the function: not killed): $(grep -c ': no tests$' results.txt || true)"
  echo "# segfault (the mutant killed the test process itself: counted as killed): $(grep -c ': segfault$' results.txt || true)"
  echo "# not killed, with their diffs in ${out%.txt}.diff:"
  echo "$sel" | grep -v ': timeout$' || true
} > "$out"
: > "${out%.txt}.diff"
for m in $(echo "$sel" | grep -E ': (survived|no tests)$' | cut -d: -f1); do mutmut show "$m" >> "${out%.txt}.diff" 2>&1 || true; done
python3 "$repo/scripts/mutation_triage.py" < "${out%.txt}.diff" > "${out%.txt}.triage" || true
grep -E '^(message|review):' "${out%.txt}.triage" | sed 's/^/# triage (survived + no tests): /' >> "$out" || true
cat "$out"
