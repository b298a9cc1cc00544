#!/usr/bin/env bash
# GIP issue: DP-SGD vs Random-k vs GIP on MNIST and Fashion-MNIST with the 26,010-parameter
# CNN at honest ε ∈ {1, 2, 4} (δ = 1e-5), one seed, 10 epochs (the paper's CIFAR-10/SVHN
# WRN-16-4 setting is out of reach here). Same hyper-parameters for all three mechanisms:
# the DP-SGD defaults (B = 2048, SGD lr 2, momentum 0.9, C = 0.1, tanh); GIP keeps its paper
# schedule (k linear 1 → 0.1, 1 % of ε for the index selection), Random-k its exponential
# 1 → 0.5. Writes results/gip/<dataset>_<mechanism>_eps<ε>.json.
set -euo pipefail
out=results/gip
mkdir -p "$out"
for dataset in mnist fashion-mnist; do
  for eps in 1 2 4; do
    for mech in dpsgd random-k gip; do
      f="$out/${dataset}_${mech}_eps${eps}.json"
      [ -f "$f" ] && continue
      privgrad train --mechanism "$mech" --dataset "$dataset" --epsilon "$eps" --epochs 10 \
        --quiet --json --out "$f" --db runs/gip.db > /dev/null
      echo "done $f"
    done
  done
done
