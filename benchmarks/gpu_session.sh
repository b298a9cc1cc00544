#!/usr/bin/env bash
# Every GPU check in one command, for a session lent a GPU (device tool, or any CUDA machine
# with torch): the CUDA cases of the equivalence tests (per-sample rules, the fused norm
# kernels' and their masked forms, spectral, GIP, layers, mixed precision, Hugging Face
# rules, and the captured step of privgrad/graphed.py against the eager one); the step-time
# benchmark with Opacus, fastDP (when .fastdp/ holds it, see benchmarks/fastdp_contender.py),
# the fused kernels (but on WRN-16-4), the captured step (dpsgd-graphed) and on WRN-16-4 the
# eager and captured steps with three TF32 tensor-core products per cuBLAS/cuDNN product
# (dpsgd-gemm-x3, dpsgd-graphed-gemm-x3: EngineFlags.gemm_dot) as contenders, in model
# groups (one failing group cannot take the others with it), the launch-bound models first;
# and the profile of where the GPU time of the non-private, DP-SGD and captured DP-SGD steps goes
# (benchmarks/gpu_profile.py: kernel time, launches, busy fraction). Left out for time: the
# per-layer conv forms (benchmarks/conv_rules.py --device cuda) and the capture probe
# (benchmarks/graph_probe.py), run at 5bdb6c7; the micro-batch check
# (benchmarks/microbatch_check.py, passed at b232bb4), the LeNet-5 and nn.Transformer groups
# and the bf16 steps (measured at c573c01 and 5bdb6c7), and the fused kernels' tensor-core
# form (dpsgd-fused-x3, slower than the default form at 613dc9e), and the 64 MB CUDA chunks
# (dpsgd-chunk64, the default before 256 MB; A/B at 613dc9e). The limits fit what an H100
# took at 613dc9e (results/bench/gpu_h100_613dc9e/: 418 s in all, the pytest 105 s with
# Triton's first compiles).
# Wheels of packages the machine lacks (dp-accounting, dm-tree, opacus) may lie in .whl/ (see
# the device tool's README); benchmarks/gpu_prepare.sh makes the tree, wheels and fastDP included,
# and prints the one device call that runs this script (and a pending rerun, if one is named).
# PRIVGRAD_COMMIT names the commit when the tree has no .git.
# Outputs go to $OUT (default: gpu-out/), eight files (the device tool returns at most 8). Its
# steps' limits add up to under 10 minutes, the device tool's limit per command (they took 418 s
# at 613dc9e, before the 30 s sketch part); they run in order of need, so a cut loses the last
# (the profile). A session short of device time may run
# only some parts: GPU_PARTS names them (default "pytest cnn cnn-x16,transformer model3-gn
# wrn16-4 sketch profile": "sketch" times the per-step sketches of trained values,
# benchmarks/sketch_cost.py; "graph-load", about 4 minutes, runs the captured step's CUDA cases beside a
# load, benchmarks/gpu_load.py; "mixtral", about 1 minute, times DP-SGD on a mixture of
# experts, results/bench/moe_cpu.md) and PYTEST_K narrows the pytest cases (default "cuda");
# PYTEST_LIMIT (default 120 s, what the default parts leave) may be raised when fewer parts run.
#
#     PRIVGRAD_COMMIT=$(git rev-parse HEAD) bash benchmarks/gpu_session.sh
#     GPU_PARTS="pytest wrn16-4" PYTEST_K="cuda and tf32x3" bash benchmarks/gpu_session.sh
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
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || exit 1
python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])"
want() { [[ " ${GPU_PARTS:-pytest cnn cnn-x16,transformer model3-gn wrn16-4 sketch profile} " == *" $1 "* ]]; }
if want graph-load; then
    # the captured step's CUDA cases, five times, beside 8 processes of matmuls: on an H200 one
    # case failed once under such a load and never alone (results/bench/README.md, fifth GPU
    # run); each round's whole output is kept
    for i in 1 2 3 4 5 6 7 8; do timeout 170 python3 benchmarks/gpu_load.py 160 & done
    sleep 10
    for round in 1 2 3 4 5; do
        echo "== round $round" >> "$out/graph_load.log"
        timeout 60 python3 -m pytest -o addopts= -q --tb=short -p no:cacheprovider -k cuda \
            tests/core/test_graphed.py >> "$out/graph_load.log" 2>&1
        echo "graph-load round $round: rc $? at ${SECONDS}s"
    done
    kill $(jobs -p) 2>/dev/null
    wait
fi
if want pytest; then
    # -o addopts=: one process, as timed before (the device may lack pytest-xdist, which the
    # addopts of pyproject.toml ask for)
    timeout "${PYTEST_LIMIT:-120}" python3 -m pytest -o addopts= -q --tb=short -p no:cacheprovider -k "${PYTEST_K:-cuda}" \
        tests/core/test_graphed.py tests/core/test_per_sample.py tests/core/test_spectral.py \
        tests/core/test_gip.py tests/core/test_layers.py tests/core/test_precision.py \
        tests/core/test_hf.py tests/core/test_shared_tables.py tests/core/test_experts.py \
        tests/core/test_mixers.py \
        > "$out/pytest_cuda.log" 2>&1
    echo "pytest (CUDA cases): rc $? at ${SECONDS}s"; tail -3 "$out/pytest_cuda.log"
fi
extra=dpsgd-graphed,dpsgd-fused,fastdp-bk
# one JSON line per group in step_time.jsonl (each setting's rows also go to step_time.log as
# they finish, so a group cut short by its limit keeps them)
for group in "cnn:70:256" "cnn-x16,transformer:105:" "model3-gn:55:256" "wrn16-4:165:256,1024" "mixtral:60:"; do
    IFS=: read -r models limit batches <<< "$group"
    want "$models" || continue
    rounds=4
    [ "$models" = wrn16-4 ] && rounds=3
    args=(--device cuda --models "$models" --json --rounds $rounds)
    [ -n "$batches" ] && args+=(--batch-size "$batches")
    if [ "$models" = cnn ]; then
        args+=(--contenders non-private,dpsgd,gip,random-k,dp-adam,opacus-ghost,opacus-flat,$extra)
    elif [ "$models" = mixtral ]; then
        # a mixture of experts (transformers' Mixtral from a config; named in GPU_PARTS only)
        args+=(--contenders non-private,dpsgd)
    elif [ "$models" = wrn16-4 ]; then
        # the fused kernels measured slower here (5bdb6c7; tensor-core form 613dc9e);
        # book-keeping alone is the memory question, gemm-x3 the tensor-core one
        args+=(--contenders non-private,dpsgd,dpsgd-graphed,dpsgd-gemm-x3,dpsgd-graphed-gemm-x3,dpsgd-bookkept,opacus-ghost,opacus-flat,fastdp-bk)
    else
        args+=(--contenders non-private,dpsgd,opacus-ghost,opacus-flat,$extra)
    fi
    timeout "$limit" python3 benchmarks/step_time.py "${args[@]}" 2>> "$out/step_time.log" \
        | tail -1 >> "$out/step_time.jsonl"
    echo "step_time $models: rc ${PIPESTATUS[0]} at ${SECONDS}s"
done
if want sketch; then
    # the per-step sketches of trained values (a reduction per parameter tensor each step,
    # outside the captured graph): their share of the DP-SGD step
    timeout 30 python3 benchmarks/sketch_cost.py --device cuda --models cnn:256,wrn16-4:256 \
        --json 2> "$out/sketch_cost.log" | tail -1 > "$out/sketch_cost.json"
    echo "sketch_cost: rc ${PIPESTATUS[0]} at ${SECONDS}s"; grep -v Warning "$out/sketch_cost.log" | tail -3
fi
if want profile; then
    timeout 50 python3 benchmarks/gpu_profile.py --contenders non-private,dpsgd,dpsgd-graphed \
        --json > "$out/gpu_profile.json" 2> "$out/gpu_profile.log"
    echo "gpu_profile: rc $? at ${SECONDS}s"; grep -v Warning "$out/gpu_profile.log" | tail -20
fi
[ ! -f "$out/step_time.log" ] || grep -v Warning "$out/step_time.log" | grep -v "rows \[" | tail -40
