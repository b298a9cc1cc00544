#!/usr/bin/env bash
# Which CPU thread setting should `privgrad train` use by default? Times whole processes
# (start-up, data, calibration, training, evaluation) with farm-bench, on an idle machine and
# with a CPU-burning process per core minus one ("loaded"), for three candidates:
#   2-active   --threads 2, OMP_WAIT_POLICY=ACTIVE   (PyTorch's own default on this 2-core machine)
#   2-passive  --threads 2, OMP_WAIT_POLICY=PASSIVE
#   1          --threads 1, OMP_WAIT_POLICY=PASSIVE
# each paired, run by run, against the 1-thread candidate (farm-bench --vs), so the ratios
# are read against the same drifting machine. farm-bench is this workplace's timing tool
# (not a dependency of privgrad). Output: results/bench/threads.txt (farm-bench's reports).
#
#     bash benchmarks/threads.sh            # about 6 minutes on 2 cores (RUNS=5: about 10)
set -euo pipefail
cd "$(dirname "$0")/.."
out=results/bench/threads.txt
db=$(mktemp -d)/threads.db
run="privgrad train --limit-train 3000 --epochs 2 --noise-multiplier 1 --device cpu --quiet --db $db"
one="env OMP_WAIT_POLICY=PASSIVE $run --threads 1"
cores=$(python -c "import os; print(len(os.sched_getaffinity(0)))")
{
  echo "# benchmarks/threads.sh, $(date -u +%FT%TZ), $(git rev-parse --short HEAD), $cores cores"
  echo "# command: $run --threads N"
  for condition in idle loaded; do
    burners=()
    if [ "$condition" = loaded ]; then
      for _ in $(seq $((cores > 1 ? cores - 1 : 1))); do
        python -c "while True: pass" & burners+=($!)
      done
    fi
    for candidate in "2-active:ACTIVE:2" "2-passive:PASSIVE:2"; do
      IFS=: read -r name policy n <<<"$candidate"
      echo "## $condition: $name (A) vs 1 thread (B)"
      farm-bench -n "${RUNS:-3}" --timeout 1500 --vs "$one" -- env OMP_WAIT_POLICY="$policy" $run --threads "$n"
    done
    for pid in "${burners[@]:-}"; do [ -n "$pid" ] && kill "$pid"; done
  done
} 2>&1 | tee "$out"
