#!/usr/bin/env bash
# Issue 8, two-GPU version (nvidia-h200-x2): one rank per GPU.
#   1. the consensus drills (healthy, host fails on rank 1, build fails on rank 1)
#   2. bench transfer on both GPUs at once (512 KiB and 2 MiB blocks)
#   3. a short main job with configs/h200.yaml
# Everything is logged under $OUT as it goes.
set -u
source gpu/env.sh || exit 1
nvidia-smi -L | tee "$OUT/x2.log"
sed -e 's/device: cuda:0/device: auto/' -e 's/"build fails on rank 2", "build@2"/"build fails on rank 1", "build@1"/' \
    gpu/consensus.sh > /tmp/cons2.sh
echo "== consensus, 2 ranks, one per GPU" | tee -a "$OUT/x2.log"
NP=2 GPU_GIB=2 HOST_GIB=4 timeout 90 bash /tmp/cons2.sh 2>&1 | grep -v "pinning host" | tee -a "$OUT/x2.log"
echo "== bench transfer on both GPUs at once" | tee -a "$OUT/x2.log"
timeout 120 "$MPIEXEC" -n 2 bash -c 'CUDA_VISIBLE_DEVICES=$PMI_RANK python3 -m kvdist bench transfer --seconds 0.25 2>&1 | sed "s/^/[rank $PMI_RANK] /"' \
    | tee -a "$OUT/x2.log"
echo "== main job, 2 ranks" | tee -a "$OUT/x2.log"
NP=2 REQUESTS=${REQUESTS:-120} MPIEXEC_TIMEOUT=100 timeout 110 bash gpu/sim.sh 2>&1 | tee -a "$OUT/x2.log"
