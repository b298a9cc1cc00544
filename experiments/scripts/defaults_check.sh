#!/usr/bin/env bash
# Issue 15's "done when": every classifier mechanism with its defaults alone (apart from
# --mechanism and the scale), on the MNIST test set. One job at a time, one thread:
#   OMP_NUM_THREADS=1 bash experiments/scripts/defaults_check.sh [MECHANISM ...]
# Writes results/defaults/check/<mechanism>.json (DEFAULTS_OUT: elsewhere, e.g. from a clean
# worktree); existing files are skipped.
set -euo pipefail
out=${DEFAULTS_OUT:-results/defaults/check}
mkdir -p "$out"
for mech in ${*:-dpsgd dp-adam dp-signsgd dp-signadam gip random-k spectral-dp gredp non-private}; do
  f="$out/$mech.json"
  [ -f "$f" ] && continue
  privgrad train --mechanism "$mech" --limit-train 10000 --epochs 3 --quiet --json --db runs/defaults.db --out "$f" > /dev/null
  echo "$f: $(python -c "import json,sys; r=json.load(open(sys.argv[1])); print(r['test_accuracy'], r['wall_time_s'], 's')" "$f")"
done
