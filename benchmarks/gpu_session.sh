#!/usr/bin/env bash
# The GPU checks of issue 16 in one command, for a session lent a GPU (device tool, or any
# CUDA machine with torch): the CUDA cases of the fast-path equivalence tests and the GIP
# sampler tests, the CUDA A/B (benchmarks/cuda_ab.py), then the step-time benchmark in three
# model groups (one failing group cannot take the others with it) and on WRN-16-4, a model of
# the size people train on a GPU (not in the default matrix). Wheels of packages the
# machine lacks (dp-accounting, dm-tree, opacus) may lie in .whl/ (see the device tool's
# README); outputs go to $OUT (default: gpu-out/). About 5 minutes on an H200 (2026-11-26:
# 227 s without WRN-16-4, whose group took 34 s alone), at most 9.8 minutes by its time
# limits (the device tool allows 10 per command).
#
#     bash benchmarks/gpu_session.sh
set -u
out=${OUT:-gpu-out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || exit 1
timeout 60 python3 -m pytest -q -p no:cacheprovider -k cuda tests/test_per_sample.py tests/test_spectral.py \
    tests/test_gip.py > "$out/pytest_cuda.log" 2>&1
echo "pytest (CUDA cases): rc $?"; tail -3 "$out/pytest_cuda.log"
timeout 140 python3 benchmarks/cuda_ab.py --device cuda --rounds 5 --json > "$out/cuda_ab.json" 2> "$out/cuda_ab.log"
echo "cuda_ab: rc $?"; tail -8 "$out/cuda_ab.log"
for group in cnn,cnn-x16,model3-gn:120 transformer:60 lenet5,model1,lenet5-bc:80 wrn16-4:120; do
    limit=${group#*:} group=${group%:*}
    timeout "$limit" python3 benchmarks/step_time.py --device cuda --models "$group" --json \
        > "$out/step_time_${group//,/_}.json" 2>> "$out/step_time.log"
    echo "step_time $group: rc $? at ${SECONDS}s"
done
