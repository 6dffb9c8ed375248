#!/usr/bin/env bash
# One call on nvidia-h200-x2 (about 7 minutes): everything CUDA after the transfer engine's
# numpy rewrite, then issue 8's two-GPU run.
#   1. on GPU 0 alone: every CUDA test (transfer race scenarios on gated streams, staging
#      race tests, integrity churn) and bench transfer (medians of 3 interleaved rounds)
#   2. gpu/x2.sh: consensus drills incl. the stall, bench transfer on both GPUs at once,
#      the main job on 2 ranks
# Logs under $OUT.
set -u
source gpu/env.sh || exit 1
export CUDA_MODULE_LOADING=EAGER
O=${OUT:-/tmp/out}; mkdir -p "$O"
nvidia-smi -L; nproc; date -u
echo "== CUDA tests on GPU 0"
CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_transfer_cuda.py \
    tests/test_transfer_scenarios.py tests/test_transfer_engine.py tests/test_staging_cuda.py \
    tests/test_staging.py tests/test_integrity.py 2>&1 | tee "$O/cuda-tests.log" | tail -8
echo "== bench transfer, GPU 0 alone"
CUDA_VISIBLE_DEVICES=0 python3 -m kvdist bench transfer --json "$O/bench_transfer_x2_gpu0.json" \
    2>/tmp/bench.err | tee "$O/bench_transfer_gpu0.log" | tail -12 || tail -20 /tmp/bench.err
REQUESTS=${REQUESTS:-400} bash gpu/x2.sh
