#!/usr/bin/env bash
# Issue 39, item 6: the default MNIST run (`privgrad train`, nothing else but the precision
# and the seed) in fp32 and bf16, seeds 0-2. Two jobs at a time, one thread each; run from a
# clean checkout so that the records name a commit without -dirty:
#   OMP_NUM_THREADS=1 bash experiments/scripts/precision.sh
# Writes results/precision/<precision>_seed<seed>.json; existing files are skipped.
set -euo pipefail
out=results/precision
mkdir -p "$out" runs
one() {
  f="$out/$1_seed$2.json"
  [ -f "$f" ] && return
  python -m privgrad train --precision "$1" --seed "$2" --threads 1 --quiet --json \
    --db "runs/precision_$1_$2.db" --out "$f" > /dev/null
  echo "$f: $(python -c "import json,sys; r=json.load(open(sys.argv[1])); print(r['test_accuracy'], r['epsilon'], r['wall_time_s'], 's')" "$f")"
}
for seed in 0 1 2; do
  one fp32 "$seed" &
  one bf16 "$seed" &
  wait
done
