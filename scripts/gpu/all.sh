#!/usr/bin/env bash
# Every GPU run in one call (about 10 minutes on one H200): make gpu-test (the CUDA tests),
# make gpu-bench (bench transfer, staging, pin), the start-up drills with 4 ranks on GPU 0
# (scripts/gpu/consensus.sh) and the main job, one rank, configs/h200.yaml
# (scripts/gpu/sim.sh). Logs under $OUT (default /tmp/out).
# From the repo root on a CUDA machine with kvdist installed:  bash scripts/gpu/all.sh
set -u
if [ -d .whl ]; then source scripts/gpu/env.sh || exit 1; fi  # this workplace's carried wheels
command -v make >/dev/null || { echo "scripts/gpu/all.sh needs make"; exit 1; }
O=${OUT:-/tmp/out}; mkdir -p "$O"
nvidia-smi -L; nproc; date -u
echo "== make gpu-test"
make -s gpu-test GPU_PY=python3 2>&1 | tee "$O/gpu-test.log" | tail -12
echo "== make gpu-bench"
make -s gpu-bench GPU_PY=python3 2>&1 | tee "$O/gpu-bench.log" | tail -60
echo "== start-up drills, 4 ranks on one GPU"
timeout 150 bash scripts/gpu/consensus.sh 2>&1 | grep -v "pinning host" | tee "$O/consensus.log" | tail -42
echo "== main job, 4 ranks on one GPU"
REQUESTS=${REQUESTS:-400} MPIEXEC_TIMEOUT=200 timeout 210 bash scripts/gpu/sim.sh 2>&1 | tee "$O/sim.log" | tail -40
