#!/usr/bin/env bash
# Issue 3 on the H200 (a few minutes): facts about cudaMemcpyBatchAsync on this image, the
# transfer race scenarios with streams gated on a host flag (rule on: every copy path;
# rule off: wrong bytes), the CUDA integrity churns, then `bench transfer`.
# From the repo root on a CUDA machine with kvdist installed.
set -u
if [ -d .whl ]; then source scripts/gpu/env.sh || exit 1; fi  # this workplace's carried wheels
export CUDA_MODULE_LOADING=EAGER  # no lazy module loads while a test holds a stream
python3 scripts/gpu/memcpy_attrs.py
nvcc -o /tmp/memcpy_attrs scripts/gpu/memcpy_attrs.cu 2>&1 | tail -3 && /tmp/memcpy_attrs
python3 -m pytest -q -p no:cacheprovider -rA -s tests/test_transfer_cuda.py tests/test_transfer_scenarios.py \
    "tests/test_integrity.py::test_churn_on_cuda_with_pinned_host_tier" 2>&1 \
    | grep -v "^PASSED\|^SKIPPED" | tail -60
# (progress bars go to stderr: shown only if the bench fails)
python3 -m kvdist bench transfer 2>/tmp/bench.err || tail -20 /tmp/bench.err
