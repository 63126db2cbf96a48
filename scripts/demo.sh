#!/usr/bin/env bash
# The main job on a fresh machine: set up, start memsnapd, run a sample job with 256 MiB of random memory
# and a counter, checkpoint it into the memory tier, drain it to storage, evict the tier copy, restore it
# from storage, and show that it carries on at the next tick with the same memory digest. Run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
scripts/setup.sh

base=/var/tmp/memsnap-demo
tier=/dev/shm/memsnap-demo
sock=/run/memsnap-demo/memsnapd.sock
rm -rf "$base" "$tier"; mkdir -p "$base" /run/memsnap-demo
export MEMSNAP_SOCKET=$sock
ctl() { python3 -m memsnap.cli "$@"; }
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
json() { python3 -c "import json,sys; print(json.load(sys.stdin)$1)"; }

cleanup() {
  [ -n "${pids:-}" ] && kill -9 $pids 2>/dev/null || true
  [ -n "${dpid:-}" ] && kill "$dpid" 2>/dev/null && wait "$dpid" 2>/dev/null || true
}
trap cleanup EXIT

say "starting memsnapd (tier $tier, store $base/store, bandwidth cap 200M/s)"
python3 -m memsnap.daemon --config /dev/null --socket "$sock" --tier-dir "$tier" --store-dir "$base/store" \
  --state-dir "$base/state" --drain-bandwidth 200M >"$base/memsnapd.log" 2>&1 &
dpid=$!
for _ in $(seq 100); do ctl status >/dev/null 2>&1 && break; sleep 0.1; done
ctl status

say "memsnapctl run: a job with 256 MiB of random memory and a counter, in its own PID namespace"
run=$(ctl --json run --name demo -- python3 "$REPO/tests/workloads/counter.py" --mib 256 --interval 0.2 --digest-every 5)
echo "started job $(echo "$run" | json "['job']") as pid $(echo "$run" | json "['pid']")"
job=$(echo "$run" | json "['job']"); pid=$(echo "$run" | json "['pid']"); log=$(echo "$run" | json "['log']")
pids="$pid"
sleep 3; tail -n 3 "$log"

say "memsnapctl checkpoint --stop: dump into the memory tier, then end the job"
ck=$(ctl checkpoint "$job" --stop)   # e.g. "ck-...: staged, 264.4 MiB, job frozen 138 ms (dump 379 ms), in tier"
echo "$ck"
id=${ck%%:*}
last=$(grep "^tick .* $pid " "$log" | tail -n 1)
echo "last tick before the checkpoint: $last"

say "memsnapctl watch: the drain to storage runs in the background"
ctl watch "$id"
ctl show "$id"

say "memsnapctl evict + restore: the tier copy is dropped, so restore fetches and verifies the stored copy"
ctl evict "$id"
r=$(ctl restore "$id"); echo "$r"   # "restored ck-... as job-... (pid N) in ... (verify ..., fetched from the store in ...)"
newpid=$(echo "$r" | sed -n 's/.*(pid \([0-9]*\)).*/\1/p'); pids="$pids $newpid"
newjob=$(echo "$r" | sed -n 's/.* as \(job-[0-9a-f]*\) .*/\1/p')
sleep 3
echo "memsnapctl logs $newjob (each restore writes a log of its own):"
ctl logs "$newjob" | head -n 4
log=$(ctl --json jobs | python3 -c "import json,sys; print(next(j['log_path'] for j in json.load(sys.stdin) if j['id'] == '$newjob'))")
n_last=$(echo "$last" | awk '{print $2}'); d_last=$(echo "$last" | awk '{print $4}')
first=$(grep "^tick .* $newpid " "$log" | head -n 1)
n_first=$(echo "$first" | awk '{print $2}'); d_first=$(echo "$first" | awk '{print $4}')
if [ "$n_first" = $((n_last + 1)) ] && [ "$d_first" = "$d_last" ]; then
  printf '\n\033[32mOK: the job continued at tick %s (after %s) with the same memory digest %s\033[0m\n' \
    "$n_first" "$n_last" "$d_first"
else
  echo "FAILED: expected tick $((n_last + 1)) with digest $d_last, got: $first" >&2; exit 1
fi
ctl list
