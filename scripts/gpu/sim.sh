#!/usr/bin/env bash
# The main job on the H200, step-counted (--no-compare: bookkeeping replays, no clock;
# scripts/gpu/compare.sh has the real-time comparison): configs/h200.yaml, Llama-3-8B at
# TP=1 (2 MiB blocks; 12 GiB GPU tier, 24 GiB pinned host, 24 GiB disk). A short
# smoke run first if SMOKE=N (stops the script if it fails), then the full run; prints the final
# tables. Run from the repo root on the device machine:
#   bash scripts/gpu/sim.sh                 (sources scripts/gpu/env.sh where .whl/ is carried)
# Knobs: NP=1 CONFIG=configs/h200.yaml REQUESTS=<override> SMOKE=<requests of a short run first>
set -u
if [ -d .whl ] && [ -z "${MPIEXEC:-}" ]; then source scripts/gpu/env.sh || exit 1; fi  # this workplace's carried wheels
NP=${NP:-1}
CONFIG=${CONFIG:-configs/h200.yaml}
SMOKE=${SMOKE:-0}
OUT=${OUT:-/tmp/kvdist-runs}
export MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-580}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
df -h /tmp | tail -1
python3 -c "import torch, matplotlib; print('torch', torch.__version__, 'matplotlib', matplotlib.__version__)" \
    2>/dev/null || echo "(matplotlib missing: no plots)"
run() {  # progress bars go to stderr: kept out of the log, shown only on failure
    python3 launch/kvdist-launch -n "$NP" --python python3 run --no-compare --config "$CONFIG" --out "$OUT" "$@" \
        2>/tmp/kvdist-sim.err
    local rc=$?
    if [ $rc -ne 0 ]; then echo "exit status $rc"; tail -40 /tmp/kvdist-sim.err; fi
    return $rc
}
if [ "$SMOKE" != 0 ]; then
    echo "== smoke: $SMOKE requests"
    run --requests "$SMOKE" --quiet >/tmp/kvdist-smoke.log; rc=$?
    tail -14 /tmp/kvdist-smoke.log
    [ $rc -eq 0 ] || exit $rc
fi
echo "== full run"
start=$(date +%s)
run ${REQUESTS:+--requests "$REQUESTS"}
echo "wall: $(( $(date +%s) - start )) s (whole job, start-up included)"
