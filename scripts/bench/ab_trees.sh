#!/usr/bin/env bash
# Before/after of two memsnap trees in one sitting, on the paths a refactor must not slow down:
#   checkpoint, drain to the store, restore from the store (scripts/bench/ab.py, A and B alternating), and
#   moves (scripts/bench/bench_migrate.py from each tree, pipelined and lazy, trees alternating),
# at 1 and 2 GiB of random memory. Run as root:
#   scripts/bench/ab_trees.sh /path/to/before /path/to/after OUTDIR [REPS]
# Writes OUTDIR/ab-<MiB>/ab.json and OUTDIR/migrate-<before|after>-<MiB>-<rep>/migrate.json.
set -euo pipefail
before=$(realpath "$1"); after=$(realpath "$2"); out=$(realpath -m "$3"); reps=${4:-3}
mkdir -p "$out"
for mib in 1024 2048; do
  echo "== checkpoint, drain, restore from the store: $mib MiB"
  python3 "$after/scripts/bench/ab.py" --a "$before" --b "$after" --mib "$mib" --reps "$reps" --local \
    --out "$out/ab-$mib"
done
for mib in 1024 2048; do
  for rep in $(seq 1 "$reps"); do
    # (alternate which tree goes first, so that drift on a noisy machine hits both alike)
    if (( rep % 2 )); then order="before after"; else order="after before"; fi
    for name in $order; do
      tree=$before; [ "$name" = after ] && tree=$after
      echo "== move, $name, $mib MiB, rep $rep"
      (cd "$tree" && python3 scripts/bench/bench_migrate.py --mib "$mib" --runs 1 --modes pipelined,lazy \
        --lazy-mib "" --out "$out/migrate-$name-$mib-$rep" >/dev/null)
    done
  done
done
echo "done: $out"
