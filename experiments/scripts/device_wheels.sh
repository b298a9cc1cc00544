#!/usr/bin/env bash
# Downloads wheels a lent GPU machine lacks (the device tool: Python 3.12 on x86_64 Linux,
# no network there) into DEST, for gpu_rerun.sh and benchmarks/gpu_prepare.sh to carry.
#
#   bash experiments/scripts/device_wheels.sh DEST PACKAGE==VERSION...
set -euo pipefail
dest=${1:?"usage: $0 DEST PACKAGE==VERSION..."}
shift
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dest" "$@"
