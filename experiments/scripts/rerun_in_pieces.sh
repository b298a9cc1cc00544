#!/usr/bin/env bash
# Run an experiment's grid from a clean clone of one commit, for at most SECONDS, into a run
# store in FOLDER; run the same command again (in a later session) to go on. Done cells are
# skipped and a cell stopped mid-run goes on from its checkpoint (docs/experiments.md), so a
# grid longer than a session (gip-t5-cifar4k: about 50 core-hours here) runs in pieces, and
# every record names that commit, clean, and one code version (issue 41).
#
#   bash experiments/scripts/rerun_in_pieces.sh EXPERIMENT COMMIT FOLDER SECONDS
#   e.g. bash experiments/scripts/rerun_in_pieces.sh gip-t5-cifar4k 011316d /work/rerun_gip 9000
#
# JOBS cells run at once (default 2, one thread each). The store is FOLDER/EXPERIMENT.db, the
# clone FOLDER/repo. A machine's folders do not outlive it, so each piece ends by exporting the
# cells done so far into this repository, PROGRESS/reproduce/EXPERIMENT(.search).json (PROGRESS
# defaults to experiments/progress): commit them after every piece. The next piece counts them
# as done (--from-results), so a fresh machine loses only the cells that were mid-run. Once
# the dry run at the end says every cell is done, those two files are the grid's records.
#
# The body is one block, read whole before it runs: editing this file while a piece runs (in
# another session) cannot change what that piece does.
set -euo pipefail
{
    [ $# -eq 4 ] || { sed -n '8,9p' "$0" >&2; exit 2; }
    exp=$1 folder=$(realpath -m "$3") seconds=$4
    repo=$(git rev-parse --show-toplevel)
    progress=$(realpath -m "${PROGRESS:-$repo/experiments/progress}")
    commit=$(git -C "$repo" rev-parse --verify "$2^{commit}")
    mkdir -p "$folder" "$progress"
    [ -d "$folder/repo/.git" ] || git clone -q --no-checkout "$repo" "$folder/repo"
    git -C "$folder/repo" cat-file -e "$commit" 2>/dev/null || git -C "$folder/repo" fetch -q "$repo"
    git -C "$folder/repo" checkout -q --detach "$commit"
    [ -z "$(git -C "$folder/repo" status --porcelain --untracked-files=no)" ] || {
        echo "$folder/repo has changes: its records would read -dirty" >&2
        exit 1
    }
    cd "$folder/repo"  # python -m privgrad then imports this clone's privgrad
    export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
    export PRIVGRAD_DATA=${PRIVGRAD_DATA:-$(realpath -m "$repo/../shared/data")}
    python -c "from privgrad.records import git_commit, code_version; print(git_commit(), code_version())"
    date -u
    timeout "$seconds" python -m privgrad reproduce "$exp" --jobs "${JOBS:-2}" --quiet \
        --db "$folder/$exp.db" --from-results --results-dir "$progress" \
        || echo "stopped (rc $?): run again to go on"
    date -u
    python -m privgrad reproduce "$exp" --dry-run --export --from-results \
        --db "$folder/$exp.db" --results-dir "$progress" | tail -3
    exit
}
