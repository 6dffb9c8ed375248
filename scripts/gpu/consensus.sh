#!/usr/bin/env bash
# The start-up fault drills on a GPU machine (python -m kvdist bench drills): NP ranks, each
# with a real pinned host tier and a disk tier, on DEVICE (cuda:0 = all ranks share GPU 0;
# auto = one GPU per rank). Drills: healthy (cold, then warm) | host tier fails on rank 1
# (USE_NO_HOST everywhere) | build fails on rank 2 (ABORT everywhere) | the last rank stalls
# (consensus timeout 5 s: every rank raises ConsensusTimeout). Prints create() seconds per
# rank split into allocation and consensus, and the disk files left behind (none).
# From the repo root:  bash scripts/gpu/consensus.sh
# Knobs: NP=4 DEVICE=cuda:0 GPU_GIB=2 HOST_GIB=8 DISK_GIB=1
set -u
if [ -d .whl ]; then source scripts/gpu/env.sh || exit 1; fi  # this workplace's carried wheels
NP=${NP:-4}
DEVICE=${DEVICE:-cuda:0}
DIR=$(mktemp -d /tmp/kvdist-drills-XXXX)
echo "memlock: $(ulimit -l)   MemAvailable: $(awk '/MemAvailable/ {printf "%.1f GiB", $2/2^20}' /proc/meminfo)"
cat > "$DIR/drills.yaml" <<EOF_CFG
model: {num_layers: 32, num_kv_heads: 8, head_dim: 128, dtype: bfloat16}
cache:
  tokens_per_block: 16      # 2 MiB blocks
  device: $DEVICE
  gpu: {bytes: ${GPU_GIB:-2}GiB}
  host: {bytes: ${HOST_GIB:-8}GiB}
  disk: {path: $DIR/disk, bytes: ${DISK_GIB:-1}GiB}
distributed: {consensus_timeout_s: 120}
EOF_CFG
MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-400} python3 launch/kvdist-launch -n "$NP" --python python3 \
    bench drills --config "$DIR/drills.yaml"
rc=$?
echo "exit $rc"
rm -rf "$DIR"
exit $rc
