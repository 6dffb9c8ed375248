#!/usr/bin/env bash
# Issue 3 diagnostics (a few minutes): transfer_diag at 128 KiB, then bench transfer
# (medians of interleaved rounds). Logs and JSON go to $OUT.
set -u
if [ -d .whl ]; then source scripts/gpu/env.sh || exit 1; fi  # this workplace's carried wheels
export CUDA_MODULE_LOADING=EAGER
O=${OUT:-/tmp/out}; mkdir -p "$O"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,pcie.link.gen.current,pcie.link.width.current --format=csv
python3 scripts/gpu/transfer_diag.py 128KiB 4 0.4 2>&1 | grep -v "^round" | tee "$O/diag128.log"
python3 -m kvdist bench transfer --json "$O/bench_transfer.json" 2>"$O/bench.err" | tee "$O/bench_transfer.log" || tail -20 "$O/bench.err"
