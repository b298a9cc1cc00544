#!/usr/bin/env bash
# Bottleneck issue (DP-SignSGD / DP-SignAdam, Ghosh & Das Tables 3-4): a learning-rate search
# on a validation split, then the grid at ε ∈ {0.5, 1, 2}, 2 seeds, with the chosen rates.
#
#   bash experiments/scripts/bottleneck.sh search   # validation runs -> results/bottleneck/search/
#   bash experiments/scripts/bottleneck.sh grid     # test runs       -> results/bottleneck/
# (search-images, search-imdb, grid-images, grid-imdb: one half of a stage)
#   python experiments/scripts/bottleneck_table.py  # results/bottleneck/README.md
#
# Images: the 26,010-parameter CNN, B = 1024, C = 0.1, 5 epochs (≈ 293 Poisson steps), δ = 1e-5;
# DP-SGD with momentum 0.9, DP-SignSGD with momentum 0 (§5.2); relu, and the tempered sigmoid
# with tanh's parameters (s = 2, T = 2, o = 1: --activation tanh) for the -TS rows.
# IMDB: the BiLSTM, B = 1024, C = 0.1, 2 epochs (≈ 49 steps), Adam for both.
# Search: ε = 1, seed 0, 10,000 (images) / 5,000 (IMDB) training examples held out
# (`--validation`, one fixed split); the grid uses the rate with the best validation accuracy
# (bottleneck_table.py --best). Existing files are kept; `JOBS` runs in parallel (default 2).
set -euo pipefail
stage=${1:?usage: bottleneck.sh search|search-images|search-imdb|grid|grid-images|grid-imdb}
case "$stage" in search|search-images|search-imdb|grid|grid-images|grid-imdb) ;;
  *) echo "usage: bottleneck.sh search|search-images|search-imdb|grid|grid-images|grid-imdb" >&2; exit 2 ;;
esac
out=results/bottleneck
db=runs/bottleneck.db
jobs=${JOBS:-2}
image_common="--model cnn --batch-size 1024 --clip 0.1 --epochs 5 --delta 1e-5"
imdb_common="--dataset imdb --model bilstm --activation relu --batch-size 1024 --clip 0.1 --epochs 2 --delta 1e-5"
mkdir -p "$out/search"
cmds=()
add() {  # add <file> <privgrad train arguments...>
  local f="$1"; shift
  [ -f "$f" ] || cmds+=("privgrad train $* --quiet --json --db $db --out $f > /dev/null && echo done $f")
}
opts() {  # opts <method>: mechanism and optimizer settings of a method
  case "$1" in
    dpsgd) echo "--mechanism dpsgd --momentum 0.9" ;;
    dp-signsgd) echo "--mechanism dp-signsgd --momentum 0" ;;
    dp-adam) echo "--mechanism dp-adam" ;;
    dp-signadam) echo "--mechanism dp-signadam" ;;
  esac
}
best() { python experiments/scripts/bottleneck_table.py --best "$1" "$2" "$3"; }
case "$stage" in search|search-images)
  for ds in mnist fashion-mnist; do
    for act in relu tanh; do
      for lr in 1 2 4 8; do add "$out/search/${ds}_${act}_dpsgd_lr$lr.json" \
        --dataset $ds --activation $act $image_common $(opts dpsgd) --lr $lr --epsilon 1 --seed 0 --validation 10000; done
      for lr in 0.0003 0.001 0.003 0.01 0.03; do add "$out/search/${ds}_${act}_dp-signsgd_lr$lr.json" \
        --dataset $ds --activation $act $image_common $(opts dp-signsgd) --lr $lr --epsilon 1 --seed 0 --validation 10000; done
    done
  done ;;
esac
case "$stage" in search|search-imdb)
  for m in dp-adam dp-signadam; do
    for lr in 0.001 0.003 0.01 0.03; do add "$out/search/imdb_relu_${m}_lr$lr.json" \
      $imdb_common $(opts $m) --lr $lr --epsilon 1 --seed 0 --validation 5000; done
  done ;;
esac
case "$stage" in grid|grid-images)
  for eps in 0.5 1 2; do
    for seed in 0 1; do
      for ds in mnist fashion-mnist; do
        for act in relu tanh; do
          for m in dpsgd dp-signsgd; do add "$out/${ds}_${act}_${m}_eps${eps}_seed$seed.json" \
            --dataset $ds --activation $act $image_common $(opts $m) --lr "$(best $ds $act $m)" --epsilon $eps --seed $seed
          done
        done
      done
    done
  done ;;
esac
case "$stage" in grid|grid-imdb)
  for eps in 0.5 1 2; do
    for seed in 0 1; do
      for m in dp-adam dp-signadam; do add "$out/imdb_relu_${m}_eps${eps}_seed$seed.json" \
        $imdb_common $(opts $m) --lr "$(best imdb relu $m)" --epsilon $eps --seed $seed
      done
    done
  done ;;
esac
echo "${#cmds[@]} runs to do"
printf '%s\n' "${cmds[@]}" | xargs -P "$jobs" -I{} bash -c "{}"
