#!/usr/bin/env bash
# The check run of issue 38 ("benchmark unchanged within noise"): benchmarks/step_time.py at
# d742391 (before the session's redesign) and at f26a1a1 (after it), alternated process by
# process on one idle 2-core machine, same venv (torch 2.13.0 CPU, opacus 1.6.0).
#   git worktree add /tmp/benchold d742391
#   bash results/bench/layout_check/command.sh && python results/bench/layout_check/summarize.py
set -u
export OMP_WAIT_POLICY=PASSIVE
out=$PWD/results/bench/layout_check
new=$PWD
for i in 1 2 3; do
  for v in old new; do
    if [ $v = old ]; then dir=/tmp/benchold; else dir=$new; fi
    (cd $dir && PYTHONPATH=$dir python benchmarks/step_time.py --models cnn \
      --contenders non-private,dpsgd,gip --batch-size 256 --no-memory --rounds 15 --threads 1 \
      --json > "$out/$v-$i.json" 2> /dev/null)
    echo "$v $i rc=$?"
  done
done
