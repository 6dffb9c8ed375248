#!/usr/bin/env bash
# Issue 3 diagnostics (a few minutes): transfer_diag at 128 KiB and 512 KiB, then the
# CUDA transfer and staging race tests, then bench transfer. Logs go to $OUT.
set -u
source gpu/env.sh || exit 1
export CUDA_MODULE_LOADING=EAGER
mkdir -p "${OUT:-/tmp/out}"
nproc; free -g | head -2; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,pcie.link.gen.current,pcie.link.width.current --format=csv
python3 gpu/transfer_diag.py 128KiB 3 0.5 2>&1 | tee "${OUT:-/tmp/out}/diag128.log"
python3 gpu/transfer_diag.py 512KiB 2 0.4 2>&1 | tee "${OUT:-/tmp/out}/diag512.log"
python3 -m pytest -q -p no:cacheprovider tests/test_transfer_cuda.py tests/test_staging_cuda.py 2>&1 | tail -5
