#!/usr/bin/env bash
# One call on nvidia-h200 (about 7 minutes): everything CUDA after the transfer engine's
# numpy rewrite, then what issue 8 can do on one GPU.
#   1. every CUDA test (transfer race scenarios on gated streams, staging race tests,
#      integrity churn) and bench transfer (medians of 3 interleaved rounds)
#   2. the consensus drills with 4 ranks on the GPU, incl. the stall (gpu/consensus.sh)
#   3. the main job, 4 ranks, configs/h200.yaml (gpu/sim.sh)
# Logs under $OUT.
set -u
source gpu/env.sh || exit 1
export CUDA_MODULE_LOADING=EAGER
O=${OUT:-/tmp/out}; mkdir -p "$O"
nvidia-smi -L; nproc; date -u
echo "== CUDA tests"
python3 -m pytest -q -p no:cacheprovider -rfE tests/test_transfer_cuda.py tests/test_transfer_scenarios.py \
    tests/test_transfer_engine.py tests/test_staging_cuda.py tests/test_staging.py tests/test_integrity.py \
    2>&1 | tee "$O/cuda-tests.log" | tail -6
echo "== bench transfer"
python3 -m kvdist bench transfer --json "$O/bench_transfer.json" 2>/tmp/bench.err \
    | tee "$O/bench_transfer.log" | tail -11 || tail -20 /tmp/bench.err
echo "== consensus drills, 4 ranks on one GPU"
timeout 150 bash gpu/consensus.sh 2>&1 | grep -v "pinning host" | tee "$O/consensus.log" | tail -42
echo "== main job, 4 ranks on one GPU"
REQUESTS=${REQUESTS:-400} MPIEXEC_TIMEOUT=200 timeout 210 bash gpu/sim.sh 2>&1 | tee "$O/sim.log" | tail -40
