#!/usr/bin/env bash
# Issue 28.4 on the H200 (about 5 min): cache.gpu: external, the KV connector's worker path.
# The external tier's CUDA tests (bytes of every engine block, every copy method, both
# allocations, whole and by layer group, a failed disk read), then
# scripts/gpu/external_probe.py: saves alone, loads alone and both ways at once (in one
# start() call, and in vLLM's order of steps) through ExternalPlanner/ExternalCache at
# 16-token blocks of Llama-3-8B, TP 8 and TP 1, vLLM's three allocations, with layer-wise
# waits, batches of 64 MiB against one batch a route (--submit 64,0), next to bench
# transfer at the same block size; then TP 1's staged copies against its direct ones, and TP 8's
# staged copies by 4 and 32 layer groups (layer-wise waits at TP 8 need groups; auto gives 1).
# From the repo root on a CUDA machine with kvdist installed; figures in $OUT if set.
set -u
if [ -d .whl ]; then source scripts/gpu/env.sh || exit 1; fi  # this workplace's carried wheels
out=${OUT:-/tmp}
python3 -m pytest -q -p no:cacheprovider -rA tests/test_external_cuda.py tests/test_external_cuda_on_cpu.py \
    2>&1 | grep -v "^PASSED" | tail -25
# (progress bars go to stderr: shown only if the probe fails; the JSON rows go to --json)
probe() {
    python3 scripts/gpu/external_probe.py "$@" >/tmp/external_probe.out 2>/tmp/external_probe.err
    local rc=$?
    grep -v '^{' /tmp/external_probe.out
    [ $rc = 0 ] || tail -30 /tmp/external_probe.err
}
probe --tp 8,1 --alloc per-layer,blocks,one --gather auto --submit 64,0 --json "$out/external_probe.json" "$@"
probe --tp 1 --alloc per-layer --gather staged,direct --no-bench --json "$out/external_probe_tp1.json" "$@"
probe --tp 8 --alloc per-layer --gather staged --groups 4,32 --no-bench --json "$out/external_probe_groups.json" "$@"
