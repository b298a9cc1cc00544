#!/usr/bin/env bash
# Everything a GPU session carries, made here in one command, so that a session lent a GPU
# (the device tool) spends its device time in one call: .gpu_tree/ (HEAD's privgrad,
# benchmarks, tests and MNIST for benchmarks/gpu_session.sh, with the wheels the device lacks
# for its Python 3.12 and, given fastDP's mirror from the search tool's fetch, fastDP at the
# commit benchmarks/fastdp_contender.py names) and, with RERUN=<experiment>@<commit>,
# .gpu_clone/ (that experiment's rerun from a clean clone of the commit its committed progress
# in experiments/progress/ was made with: experiments/scripts/gpu_rerun.sh prepare; none is
# pending since gip-t5-cifar4k finished on 2026-11-28).
#
#   [RERUN=gip-t5-cifar4k@011316d] bash benchmarks/gpu_prepare.sh [<fastDP git dir>]
#
# It prints the device call (its command and carry). The folders are git-ignored
# (.git/info/exclude) and travel with `carry`, 64 MiB in all. The call runs the parts the next
# GPU session needs (GPU_PARTS below): the captured step under load, then the CUDA cases, then
# what the per-step sketches of trained values cost.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
fastdp_commit=3d5cc561aa337c72f79873ccc4fe8b900b5493b5
mkdir -p .git/info
grep -qx '/.gpu_tree/' .git/info/exclude 2>/dev/null || echo '/.gpu_tree/' >> .git/info/exclude
rm -rf .gpu_tree && mkdir .gpu_tree
git archive HEAD privgrad benchmarks tests pyproject.toml data/mnist | tar -x -C .gpu_tree
bash experiments/scripts/device_wheels.sh .gpu_tree/.whl dp-accounting==0.6.0 dm-tree==0.1.10 \
    opacus==1.6.0
if [ -n "${1:-}" ]; then
    mkdir -p .gpu_tree/.fastdp
    git -C "$1" archive "$fastdp_commit" fastDP | tar -x -C .gpu_tree/.fastdp
    echo "$fastdp_commit" > .gpu_tree/.fastdp/COMMIT
else
    echo "no fastDP mirror given: the benchmark runs without its contender" >&2
fi
folders=(.gpu_tree) rerun_call=
if [ -n "${RERUN:-}" ]; then
    bash experiments/scripts/gpu_rerun.sh prepare "${RERUN#*@}"
    folders+=(.gpu_clone)
    # the rerun first (records, not timings: the benchmark must not share the GPU with it)
    rerun_call="mkdir -p \$OUT/r; (OUT=\$OUT/r JOBS=10 LIMIT=300 bash .gpu_clone/.run.sh run ${RERUN%@*}); "
fi
size=$(du -scm "${folders[@]}" | tail -1 | cut -f1)
[ "$size" -lt 64 ] || { echo "${folders[*]} take $size MiB: over the 64 MiB carry" >&2; exit 1; }
head=$(git rev-parse HEAD)
carry=$(printf '"%s", ' "${folders[@]}")
cat <<MSG
ready: $size MiB to carry. The device call (run, carry [${carry%, }], timeout_s 600):
${rerun_call}mkdir -p \$OUT/b; cd .gpu_tree && OUT=\$OUT/b GPU_PARTS="graph-load pytest sketch" PYTEST_LIMIT=180 PRIVGRAD_COMMIT=$head bash benchmarks/gpu_session.sh
MSG
