#!/usr/bin/env bash
# The remote tier on a GPU machine. Logged under $OUT (default /tmp/out).
#   1. the remote-tier MPI tests with the GPU tier on cuda:0 (4 ranks = 2 replicas x TP 2,
#      all on GPU 0): the shared-memory transport DMAs from the peer's registered mapping;
#   2. bench remote, 2 ranks on one node: 2,048 scattered blocks of 128 KiB / 512 KiB / 2 MiB
#      fetched from the peer's host tier into the GPU, next to the contiguous copy from the
#      peer's mapping and from this rank's own pinned memory (the host->GPU ceiling), and
#      the MPI path next to one contiguous MPI transfer. DEVICE=cuda:0: both ranks' tiers
#      on GPU 0 (two replicas sharing one H200); DEVICE=auto on 2+ GPUs: one GPU each;
#   3. bench remote --upkeep, 8 ranks (8 x TP 1, then 4 x TP 2) on the host's CPU cores:
#      what the directory and the TP group's agreement add to per-step bookkeeping;
#   4. where the two-node test bed can be had (root, network namespaces): bench remote
#      between its nodes (MPI over TCP on a veth pair; CPU landing), against one
#      contiguous MPI transfer between the same two ranks.
# From the repo root:  bash scripts/gpu/remote.sh     (about 7 min on one H200)
set -u
if [ -d .whl ]; then source scripts/gpu/env.sh || exit 1; fi  # this workplace's carried wheels
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOG="$OUT/remote.log"
MPIEXEC=${MPIEXEC:-mpiexec}
DEVICE=${DEVICE:-cuda:0}
nvidia-smi -L | tee "$LOG"
echo "/dev/shm: $(df -h /dev/shm | tail -1)   memlock: $(ulimit -l)" | tee -a "$LOG"
echo "== remote-tier MPI tests, GPU tier on cuda:0" | tee -a "$LOG"
KVDIST_TEST_DEVICE=cuda:0 MPIEXEC_TIMEOUT=300 timeout 320 "$MPIEXEC" -n 4 python3 -m mpi4py -m pytest -q \
    --with-mpi -m mpi -p no:cacheprovider tests/mpi/test_remote.py 2>&1 | tail -25 | tee -a "$LOG"
echo "== bench remote, 2 ranks, landing on $DEVICE" | tee -a "$LOG"
MPIEXEC_TIMEOUT=400 timeout 420 "$MPIEXEC" -n 2 python3 -m mpi4py -m kvdist bench remote --device "$DEVICE" \
    --json "$OUT/bench-remote.json" 2>&1 | grep -v "still referenced" | tee -a "$LOG"
for tp in 1 2; do
    echo "== bench remote --upkeep, 8 ranks, TP $tp" | tee -a "$LOG"
    MPIEXEC_TIMEOUT=300 timeout 320 "$MPIEXEC" -n 8 python3 -m mpi4py -m kvdist bench remote --upkeep --tp $tp \
        --steps 500 --rounds 3 2>&1 | grep -v "still referenced" | tee -a "$LOG"
done
echo "== bench remote across the two-node test bed (exit 77: no bed here)" | tee -a "$LOG"
# The bed's CLI gives node a 64 MiB of MemAvailable (for the tests); the bench needs real memory.
timeout 400 python3 -c "import sys; from tests.nodes import testbed as tb; tb.MEM_AVAILABLE = {}; \
sys.exit(tb.main(sys.argv[1:]))" -- bash -c "cd $PWD && python3 launch/kvdist-launch --python python3 -n 4 \
    --hostfile \$KVDIST_HOSTFILE --ppn 2 bench remote --device cpu --fetcher 2 --blocks 2048" 2>&1 \
    | grep -v "still referenced" | tee -a "$LOG"
