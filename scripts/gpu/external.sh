#!/usr/bin/env bash
# Issue 28.4 on the H200 (about 3 min): cache.gpu: external, the KV connector's worker path.
# The external tier's CUDA tests (bytes of every engine block, both copy methods, both
# allocations, whole and by layer group), then scripts/gpu/external_probe.py: onboard and
# offload bandwidth through ExternalPlanner/ExternalCache at 16-token blocks of Llama-3-8B,
# TP 1 and TP 8, with layer-wise waits, against bench transfer at the same block size.
# From the repo root on a CUDA machine with kvdist installed; figures in $OUT if set.
set -u
if [ -d .whl ]; then source scripts/gpu/env.sh || exit 1; fi  # this workplace's carried wheels
out=${OUT:-/tmp}
python3 -m pytest -q -p no:cacheprovider -rA tests/test_external_cuda.py tests/test_external_cuda_on_cpu.py \
    2>&1 | grep -v "^PASSED" | tail -25
# (progress bars go to stderr: shown only if the probe fails)
python3 scripts/gpu/external_probe.py --groups auto,32 --json "$out/external_probe.json" "$@" \
    2>/tmp/external_probe.err || tail -30 /tmp/external_probe.err
