#!/usr/bin/env bash
# Time, not tokens, on a GPU machine. From the repo root of a CUDA machine:
#   bash scripts/gpu/compare.sh                       (about 10 minutes on the H200)
# Measured 2026-12-01: capacity (step 3) 137 s, step 4 305 s, step 5 95 s; under a
# 10-minute limit per call run STEPS="1 2 3", then STEPS="4 5" RATE=<the rate step 3
# printed> (13.8 on the H200, 2026-12-01).
#   1. CUDA tests of the model (each attention kernel vs each segment alone, cached bf16 forward vs
#      recompute) and of layer-wise onboarding (gated onboard stream, S5 on and off);
#   2. bench layerwise: a step with 1 GiB of copies each way vs without, by block size, serial and running ahead;
#   3. capacity: all tiers (running ahead and serial) and GPU only with every request arriving at once (--rate 1000):
#      prompt tokens/s flat out; the rate of step 4 is 0.7 x GPU-only's requests/s there. Per configuration it
#      prints the cache calls a step, the host's waits on disk reads a step (issue 24's goal: none on the GPU's
#      path: a request whose prefix is on disk waits for its reads, agreed at end_step, instead of the step
#      blocking), the prefetches admission waited for, and the critical path (GPU idle, the cache on the path);
#   4. run --compare on configs/h200.yaml (Llama-3-8B, TP=1): all tiers, GPU tier only,
#      no reuse, the same trace in real time at that rate;
#   5. the disk tier throttled to $THROTTLE bytes/s (host tier 4 GiB, so the trace hits the
#      disk), all tiers vs GPU only: the onboard-or-recompute policy turns the slow disk down.
# Knobs: STEPS="1 2 3 4 5", RATE (skip the measurement of step 3), CONFIGS (step 4's, e.g.
# all-tiers,gpu-only: about 200 s instead of 305), CAPACITY_CONFIGS (step 3's; must hold
# gpu-only when RATE is not given; all-tiers,all-tiers-dropping,gpu-only measures
# cache.disk.drop_behind), THROTTLE (300MB),
# THROTTLE_REQUESTS (400). Logs and results files under $OUT.
set -u
if [ -d .whl ] && [ -z "${MPIEXEC:-}" ]; then source scripts/gpu/env.sh || exit 1; fi  # this workplace's carried wheels
O=${OUT:-/tmp/out}; mkdir -p "$O"
STEPS=${STEPS:-"1 2 3 4 5"}
THROTTLE=${THROTTLE:-300MB}
CONFIG=configs/h200.yaml
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; nproc; date -u
python3 -c "import torch; print('torch', torch.__version__)"
has() { [[ " $STEPS " == *" $1 "* ]]; }
compare() {  # $1: label, then run arguments; keeps results.json and the TTFT plot
    local label=$1; shift
    local start=$(date +%s)
    python3 -m kvdist run --quiet --out /tmp/kvdist-runs "$@" 2>/tmp/kvdist-$label.err | tee "$O/$label.log"
    local rc=${PIPESTATUS[0]}
    [ $rc -eq 0 ] || { echo "exit status $rc"; tail -30 /tmp/kvdist-$label.err; }
    cp /tmp/kvdist-runs/latest/results.json "$O/$label-results.json" 2>/dev/null
    cp /tmp/kvdist-runs/latest/ttft_cdf.png "$O/$label-ttft_cdf.png" 2>/dev/null
    python3 - "$O/$label-results.json" <<'PY' 2>/dev/null  # where each configuration's cache time went
import json, sys
for name, r in json.load(open(sys.argv[1]))["runs"].items():
    us = lambda d: ", ".join(f"{k} {v / 1e3:.2f}" for k, v in d.items())  # noqa: E731
    print(f"[{name}] ms a step: cache calls {us(r['cache_calls_us_per_step'])}; copies handed to the driver "
          f"{r['copy_entries_per_step']:.0f}, submitted in {us(r['copy_submit_us_per_step'])}; host waits on "
          f"disk reads {r['host_wait_reads_us_per_step'] / 1e3:.2f}, all disk waits {r['host_wait_us_per_step'] / 1e3:.2f} "
          f"({r['host_waits_on_disk']:,} waits)")
    loads = r.get("disk_loads") or {}
    if loads:
        print(f"[{name}] disk loads: {loads.get('started', 0):,} requests waited for their prefetch's disk reads "
              f"(admitted the step after they landed), {loads.get('steps_waited', 0):,} step boundaries found "
              f"one still reading")
    lat = r.get("latency") or {}
    if lat:
        print(f"[{name}] prompt tok/s {lat['prompt_tokens_per_s']:,.0f}; TTFT p50 {lat['ttft_ms']['p50']:.0f} ms "
              f"(arrival to first token: includes any wait for disk reads), p90 {lat['ttft_ms']['p90']:.0f} ms")
    c = r["critical_path"]
    print(f"[{name}] critical path ({'run ahead' if c['run_ahead'] else 'serial'}, {c['timers']}): step "
          f"{c['step_ms']:.1f} ms, GPU busy {c['gpu_busy_ms']:.1f}, idle {c['gpu_idle_ms']:.1f} ms "
          f"({100 * c['gpu_idle_fraction']:.1f}%), cache on the path {c['cache_on_critical_path_us'] / 1e3:.2f} ms")
PY
    echo "[$label] wall $(( $(date +%s) - start )) s"
}
if has 1; then
    echo "== CUDA tests"
    python3 -m pytest -q -s -p no:cacheprovider -rfE tests/test_attention.py tests/test_model_cuda.py tests/test_layerwise_cuda.py \
        tests/test_staging_run_ahead.py \
        2>&1 | tee "$O/cuda-tests.log" | grep -E "passed|failed|rror|relative|logit diff"
    if grep -q "test_layerwise_cuda.*FAILED\|FAILED tests/test_layerwise_cuda" "$O/cuda-tests.log"; then
        echo "layer-wise onboarding failed its CUDA test: the runs below copy whole steps (layer_groups: 1)"
        sed 's/^  recompute_when_faster: true/  recompute_when_faster: true\n  layer_groups: 1/' $CONFIG > /tmp/h200-whole.yaml
        CONFIG=/tmp/h200-whole.yaml
    fi
fi
if has 2; then
    echo "== bench layerwise"
    python3 -m kvdist bench layerwise --json "$O/layerwise.json" 2>/tmp/layerwise.err \
        | tee "$O/layerwise.log" || tail -20 /tmp/layerwise.err
fi
if has 3 && [ -z "${RATE:-}" ]; then
    echo "== capacity: every request at once"
    compare capacity --config $CONFIG --compare --configs ${CAPACITY_CONFIGS:-all-tiers,all-tiers-serial,gpu-only} --rate 1000
    RATE=$(python3 -c "import json; r = json.load(open('$O/capacity-results.json'))
print(round(0.7 * r['runs']['gpu-only']['latency']['requests_per_s'], 1))")
    echo "rate for the comparison: 0.7 x GPU-only's capacity = $RATE requests/s"
fi
RATE=${RATE:-13.8}
if has 4; then
    echo "== run --compare at $RATE requests/s"
    compare h200 --config $CONFIG --compare --rate "$RATE" ${CONFIGS:+--configs $CONFIGS}
fi
if has 5; then
    echo "== disk throttled to $THROTTLE/s, host tier 4 GiB, $RATE requests/s"
    sed -e "s|disk: {path: auto, bytes: 24GiB|disk: {path: auto, bytes: 24GiB, max_read_bytes_per_s: $THROTTLE|" \
        -e "s|host: {bytes: 24GiB}|host: {bytes: 4GiB}|" $CONFIG > /tmp/h200-throttled.yaml
    grep -q max_read_bytes_per_s /tmp/h200-throttled.yaml || { echo "throttle not set"; exit 1; }
    compare throttled --config /tmp/h200-throttled.yaml --compare --configs all-tiers,gpu-only \
        --requests "${THROTTLE_REQUESTS:-400}" --rate "$RATE"
fi
