#!/usr/bin/env bash
# The learning-rate search behind the per-mechanism defaults of `privgrad train`
# (privgrad/app/defaults.py). MNIST, the `cnn` model, target honest ε = 1, seed 0: 15,000
# training examples of which 5,000 are held out (--validation), so every run trains on
# 10,000 examples for 3 epochs at expected batch 250 (q = 1/40) and is scored on the
# validation split only, never the test set. Same budget for every mechanism: a
# five-value, factor-2 grid of lr around a first guess; a grid whose best value is on its
# edge is extended by a sixth value past that edge (run with the extra value as argument).
# Momentum 0.9 for the SGD-based mechanisms, clip 0.1 (no clipping for non-private),
# the mechanism's own optimizer: not searched. One job at a time, one thread:
#   OMP_NUM_THREADS=1 bash experiments/scripts/defaults.sh MECHANISM [LR ...]
# Writes results/defaults/search/<mechanism>_lr<lr>.json (DEFAULTS_OUT: elsewhere, e.g. from a
# clean worktree); existing files are skipped.
set -euo pipefail
out=${DEFAULTS_OUT:-results/defaults/search}
mkdir -p "$out"
declare -A grid=(
  [dpsgd]="0.5 1 2 4 8"           [gip]="0.5 1 2 4 8"          [random-k]="0.5 1 2 4 8"
  [spectral-dp]="0.5 1 2 4 8"     [gredp]="0.5 1 2 4 8"
  [dp-adam]="0.001 0.002 0.004 0.008 0.016"
  [dp-signadam]="0.0005 0.001 0.002 0.004 0.008"
  [dp-signsgd]="0.00025 0.0005 0.001 0.002 0.004"
  [non-private]="0.025 0.05 0.1 0.2 0.4"
)
mech=$1; shift
lrs=${*:-${grid[$mech]}}
eps=(--epsilon 1); [ "$mech" = non-private ] && eps=()   # non-private: no noise, ε = ∞
for lr in $lrs; do
  f="$out/${mech}_lr$lr.json"
  [ -f "$f" ] && continue
  privgrad train --mechanism "$mech" --dataset mnist --model cnn "${eps[@]}" --limit-train 15000 \
    --validation 5000 --epochs 3 --batch-size 250 --lr "$lr" --clip 0.1 --seed 0 \
    --quiet --json --db runs/defaults.db --out "$f" > /dev/null
  echo "$f: $(python -c "import json,sys; r=json.load(open(sys.argv[1])); print(r['validation_accuracy'], r['wall_time_s'], 's')" "$f")"
done
