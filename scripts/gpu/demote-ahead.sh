#!/usr/bin/env bash
# The main job on the H200 twice, side by side (4 ranks share cuda:0, configs/h200.yaml,
# 800 requests): cache.disk.demote_ahead 0 (demote only on demand), then the default
# 0.05. Compare "cache bookkeeping" and "waiting for disk work" per step. ~7 minutes.
set -u
if [ -d .whl ]; then source scripts/gpu/env.sh || exit 1; fi  # this workplace's carried wheels
O=${OUT:-/tmp/out}
sed 's|disk: {path: auto, bytes: 8GiB}|disk: {path: auto, bytes: 8GiB, demote_ahead: 0}|' \
    configs/h200.yaml > /tmp/h200-no-ahead.yaml
grep -q "demote_ahead: 0}" /tmp/h200-no-ahead.yaml || { echo "sed did not apply"; exit 1; }
for cfg in /tmp/h200-no-ahead.yaml configs/h200.yaml; do
    echo "== $cfg"
    CONFIG=$cfg REQUESTS=${REQUESTS:-800} MPIEXEC_TIMEOUT=280 timeout 290 bash scripts/gpu/sim.sh 2>&1 \
        | tee "$O/sim-$(basename "$cfg" .yaml).log" | grep -E "^kvdist run: 4|saved|this run|offloaded|per step|integrity|logits|wall"
done
