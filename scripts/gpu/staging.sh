#!/usr/bin/env bash
# Rule S3 on the H200 (a few minutes): the staging race tests with the compute stream held
# by a spin gate (protected and rule-off cases), the steady-state check, the CUDA
# integrity churn (block_table now goes through the stager), then `bench staging` with a
# stand-in forward pass (the GPU a step behind) and without one.
# From the repo root on a CUDA machine with kvdist installed.
set -u
if [ -d .whl ]; then source scripts/gpu/env.sh || exit 1; fi  # this workplace's carried wheels
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
python3 -m pytest -q -p no:cacheprovider -rA tests/test_staging_cuda.py tests/test_staging.py \
    "tests/test_integrity.py::test_churn_on_cuda_with_pinned_host_tier" 2>&1 \
    | tee "${OUT:-/tmp}/staging-pytest.log" | tail -45
# (progress bars go to stderr: shown only if the bench fails)
python3 -m kvdist bench staging 2>/tmp/bench.err || tail -20 /tmp/bench.err
python3 -m kvdist bench staging --forward-us 0 2>/tmp/bench.err || tail -20 /tmp/bench.err
