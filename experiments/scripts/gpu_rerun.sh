#!/usr/bin/env bash
# Rerun one experiment store whole on a lent GPU (the device tool) from a clean checkout, so
# that its records name a commit that is not -dirty (issue 41, item 3; the dirty-device
# entries of results/provenance_pending.toml).
#
# The device's copy of the repository carries the session's starting commit with the working
# tree on top, so records made in it read <commit>-dirty. This script runs in a shallow clone
# of HEAD instead (.gpu_clone/, git-ignored, sent with the device tool's `carry`).
#
#   here:   bash experiments/scripts/gpu_rerun.sh prepare [<commit>] [<run store>]
#   device: bash .gpu_clone/.run.sh run gip-t5-cifar4k   (carry .gpu_clone)
#
# `prepare` clones HEAD (or <commit>: the one a run store's cells were made with, so that the
# device goes on with the cells that are missing; the store is copied in as resume.db, without
# its checkpoints: a CPU checkpoint does not resume on CUDA, so a cell stopped here starts
# afresh there; the cells rerun_in_pieces.sh committed in experiments/progress/ go too, and
# count as done where that commit made them), puts the wheels the device lacks (dp-accounting,
# dm-tree, for its Python 3.12) and a copy of ../shared/data/cifar10-subset inside the clone, and checks the
# clone is clean, and copies this script into it as .run.sh (untracked: the clone stays clean),
# so that the device runs this version of `run` whatever <commit>'s copy does (011316d's
# ignored the committed progress). `run` installs the wheels, runs `privgrad reproduce <store>` with --jobs
# $JOBS (default 5), stopping at $LIMIT seconds (default 540), and returns the run store and the
# records done so far in $OUT (<store>.db, <store>(.search).json); to go on, carry the returned
# database as .gpu_clone/resume.db and run again. Copy the records into
# results/reproduce/ and remove their entries from results/provenance_pending.toml.
set -euo pipefail
case ${1:-} in
prepare)
    cd "$(git rev-parse --show-toplevel)"
    mkdir -p .git/info; grep -qx '/.gpu_clone/' .git/info/exclude 2>/dev/null || echo '/.gpu_clone/' >> .git/info/exclude
    commit=$(git rev-parse --verify "${2:-HEAD}^{commit}")
    rm -rf .gpu_clone
    # only the code and the experiment configs: what travels is capped at 64 MiB, this tree included
    git init -q .gpu_clone
    git -C .gpu_clone fetch -q --depth 1 --filter=blob:none \
        --upload-pack "git -c uploadpack.allowFilter=true -c uploadpack.allowAnySHA1InWant=true upload-pack" \
        "file://$PWD" "$commit"
    git -C .gpu_clone sparse-checkout set privgrad experiments
    git -C .gpu_clone checkout -q "$commit"
    if [ -n "${3:-}" ]; then
        python3 -c "import sqlite3, sys; sqlite3.connect(sys.argv[1]).backup(sqlite3.connect(sys.argv[2]))" \
            "$3" .gpu_clone/resume.db
    fi
    if [ -d experiments/progress/reproduce ]; then  # untracked in the clone: it stays clean
        mkdir -p .gpu_clone/.progress && cp -r experiments/progress/reproduce .gpu_clone/.progress/
    fi
    git -C .gpu_clone config core.fileMode false  # the copy may not keep executable bits
    bash experiments/scripts/device_wheels.sh .gpu_clone/.whl dp-accounting==0.6.0 dm-tree==0.1.10
    cp experiments/scripts/gpu_rerun.sh .gpu_clone/.run.sh
    data=../shared/data/cifar10-subset
    [ -d "$data" ] || { echo "no $data (the shared data folder beside the checkout)" >&2; exit 1; }
    mkdir -p .gpu_clone/.data && cp -r "$data" .gpu_clone/.data/
    [ -z "$(git -C .gpu_clone status --porcelain --untracked-files=no)" ] || exit 1
    echo "ready: $commit${3:+ with $3}, $(du -sh .gpu_clone | cut -f1) to carry"
    ;;
run)
    store=${2:?"usage: $0 run <experiment>"}
    cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"  # the clone, from .run.sh too
    out=${OUT:-gpu-out}
    work=/tmp/gpu_rerun  # the run store and its checkpoints: $OUT returns at most 8 files
    mkdir -p "$out" "$work/results"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PRIVGRAD_DATA=$PWD/.data OMP_NUM_THREADS=2
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    [ ! -f resume.db ] || cp resume.db "$work/$store.db"
    [ ! -d .progress/reproduce ] || cp -r .progress/reproduce "$work/results/"
    # records made here must not read -dirty: stop before any run if the copy changed a file
    [ -z "$(git status --porcelain --untracked-files=no)" ] || { git status --short | head; exit 1; }
    python3 -c "from privgrad.records import git_commit, code_version as v; print(git_commit(), v())"
    timeout "${LIMIT:-540}" python3 -m privgrad reproduce "$store" --jobs "${JOBS:-5}" --quiet \
        --db "$work/$store.db" --from-results --results-dir "$work/results" || echo "stopped (rc $?): run again to go on"
    python3 -m privgrad reproduce "$store" --dry-run --export --from-results \
        --db "$work/$store.db" --results-dir "$work/results" | tail -3
    cp "$work/$store.db" "$out"/
    cp "$work"/results/reproduce/*.json "$out"/ 2>/dev/null || echo "no records done yet"
    ;;
*)
    echo "usage: $0 prepare | run <experiment>" >&2
    exit 2
    ;;
esac
