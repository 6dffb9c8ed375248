#!/usr/bin/env bash
# Start-up consensus on the H200: 4 ranks share cuda:0, each with a real pinned host
# tier and a disk tier. Scenarios (one mpiexec, faults set per scenario by KVDIST_FAULTS):
#   healthy (cold, then warm) | host_tier@1 (USE_NO_HOST everywhere) | build@2 (ABORT everywhere)
#   | stall@<last rank> (consensus timeout 5 s: every rank raises ConsensusTimeout, the
#   stalled one after its sleep; last, as the stalled rank never enters the collective)
# Prints create() time per rank split into tier allocation (build) and consensus, and
# checks that a failed start leaves no disk file behind.
# Run from the repo root:  source gpu/env.sh && bash gpu/consensus.sh
# Knobs: NP=4 GPU_GIB=2 HOST_GIB=8 DISK_GIB=1
set -u
: "${MPIEXEC:?set MPIEXEC (source gpu/env.sh)}"
NP=${NP:-4}
GPU_GIB=${GPU_GIB:-2}
HOST_GIB=${HOST_GIB:-8}
DISK_GIB=${DISK_GIB:-1}
DISK_DIR=/tmp/kvdist-consensus-disk
CFG=/tmp/kvdist-consensus.yaml
DRIVER=/tmp/kvdist_consensus_drill.py
rm -rf "$DISK_DIR" && mkdir -p "$DISK_DIR"
echo "memlock: $(ulimit -l)   MemAvailable: $(awk '/MemAvailable/ {printf "%.1f GiB", $2/2^20}' /proc/meminfo)"

cat > "$CFG" <<EOF
model: {num_layers: 32, num_kv_heads: 8, head_dim: 128, dtype: bfloat16}
cache:
  tokens_per_block: 16      # 2 MiB blocks
  device: cuda:0
  gpu: {bytes: ${GPU_GIB}GiB}
  host: {bytes: ${HOST_GIB}GiB}
  disk: {path: $DISK_DIR, bytes: ${DISK_GIB}GiB}
distributed: {consensus_timeout_s: 120}
EOF
sed 's/consensus_timeout_s: 120/consensus_timeout_s: 5/' "$CFG" > "$CFG.stall"

cat > "$DRIVER" <<'EOF'
import os, sys, time, warnings
from mpi4py import MPI
from tabulate import tabulate
import kvdist

world = MPI.COMM_WORLD
cfg, disk_dir = sys.argv[1], sys.argv[2]
last = world.size - 1
warnings.simplefilter("ignore")
# The first create() of a process also pays CUDA context creation and one-time set-up.
for name, drill, path in [("healthy, cold process", "", cfg), ("healthy, warm", "", cfg),
                          ("host fails on rank 1", "host_tier@1", cfg), ("build fails on rank 2", "build@2", cfg),
                          (f"rank {last} stalls (timeout 5 s)", f"stall@{last}", cfg + ".stall")]:
    os.environ["KVDIST_FAULTS"] = drill
    world.Barrier()
    t0 = time.perf_counter()
    try:
        cache = kvdist.create(path)
        wall = time.perf_counter() - t0
        t = cache.stats()["init_seconds"]
        outcome = f"{cache.init_status.name} {'+'.join(cache.tiers)}"
        cache.close()
    except Exception as e:
        wall = time.perf_counter() - t0
        t = getattr(e, "init_seconds", {})
        outcome = f"{type(e).__name__}: {str(e)[:48]}"
    row = [world.rank, outcome, wall] + [t.get(k, float("nan")) for k in
                                          ("build", "consensus", "teardown", "plan")]
    rows = world.gather(row)
    world.Barrier()
    if world.rank == 0:
        print(f"\n== {name} (KVDIST_FAULTS={drill!r}), {world.size} ranks on one GPU")
        print(tabulate(rows, headers=["rank", "outcome", "create s", "alloc (build) s",
                                      "consensus s", "teardown s", "plan s"], floatfmt=".3f"))
        print("disk files left:", os.listdir(disk_dir))
EOF

timeout 400 "$MPIEXEC" -n "$NP" python3 "$DRIVER" "$CFG" "$DISK_DIR"
echo "exit $?"
rm -rf "$DISK_DIR" "$CFG" "$CFG.stall" "$DRIVER"
