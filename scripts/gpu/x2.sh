#!/usr/bin/env bash
# Two GPUs of one host, one rank per GPU: the start-up drills, bench transfer on both GPUs
# at once, a short main job. Logged under $OUT (default /tmp/out) as it goes.
# From the repo root:  bash scripts/gpu/x2.sh
set -u
if [ -d .whl ]; then source scripts/gpu/env.sh || exit 1; fi  # this workplace's carried wheels
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOG="$OUT/x2.log"
nvidia-smi -L | tee "$LOG"
echo "== start-up drills, 2 ranks, one per GPU" | tee -a "$LOG"
NP=2 DEVICE=auto GPU_GIB=2 HOST_GIB=4 timeout 120 bash scripts/gpu/consensus.sh 2>&1 \
    | grep -v "pinning host" | tee -a "$LOG"
echo "== bench transfer on both GPUs at once" | tee -a "$LOG"
# One process per GPU (MPICH's PMI_RANK or Open MPI's local rank picks it), output prefixed.
timeout 120 "${MPIEXEC:-mpiexec}" -n 2 bash -c 'r=${PMI_RANK:-${OMPI_COMM_WORLD_LOCAL_RANK:-0}};
    CUDA_VISIBLE_DEVICES=$r python3 -m kvdist bench transfer --seconds 0.25 2>&1 | sed "s/^/[rank $r] /"' \
    | tee -a "$LOG"
echo "== main job, 2 ranks" | tee -a "$LOG"
NP=2 REQUESTS=${REQUESTS:-120} MPIEXEC_TIMEOUT=100 timeout 110 bash scripts/gpu/sim.sh 2>&1 | tee -a "$LOG"
