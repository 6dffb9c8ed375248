#!/usr/bin/env bash
# Issue 3 on the H200 (a few minutes): facts about cudaMemcpyBatchAsync on this image, the
# transfer race scenarios with streams gated on a host flag (rule on: every copy path;
# rule off: wrong bytes), the CUDA integrity churns, then `bench transfer`.
# Run from the repo root on the device machine, with .whl carried (gpu/env.sh installs it).
set -u
source gpu/env.sh || exit 1
export CUDA_MODULE_LOADING=EAGER  # no lazy module loads while a test holds a stream
python3 - <<'PY'
import ctypes, torch
from kvdist.transfer import batchcopy as bc
print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
print("cuda-bindings", bc.bindings_version())
try:
    from cuda.bindings import runtime as rt
    print("cuda.bindings.runtime has cudaMemcpyBatchAsync:", hasattr(rt, "cudaMemcpyBatchAsync"))
    print("  runtime version via bindings:", rt.cudaRuntimeGetVersion())
    doc = (getattr(rt, "cudaMemcpyBatchAsync", None).__doc__ or "").strip().splitlines()
    print("  docstring head:", " | ".join(doc[:2]))
except Exception as e:  # noqa: BLE001
    print("cuda.bindings:", type(e).__name__, e)
c = bc.BatchCopier(torch.device("cuda"))
print("kvdist copier:", c.describe())
print("loaded libcudart has cudaMemcpyBatchAsync:", hasattr(c.lib, "cudaMemcpyBatchAsync"))
A = bc._MemcpyAttributes
print("ctypes cudaMemcpyAttributes: size", ctypes.sizeof(A), "offsets",
      [getattr(A, f).offset for f, _ in A._fields_])
PY
cat > /tmp/attrs.cu <<'CU'
#include <cstdio>
#include <cstddef>
#include <cuda_runtime.h>
int main() {
  printf("header: CUDART_VERSION %d sizeof(cudaMemcpyAttributes) %zu offsets [%zu, %zu, %zu, %zu] "
         "SrcAccessOrderStream=%d FlagPreferOverlapWithCompute=%d\n", CUDART_VERSION,
         sizeof(cudaMemcpyAttributes), offsetof(cudaMemcpyAttributes, srcAccessOrder),
         offsetof(cudaMemcpyAttributes, srcLocHint), offsetof(cudaMemcpyAttributes, dstLocHint),
         offsetof(cudaMemcpyAttributes, flags), (int)cudaMemcpySrcAccessOrderStream,
         (int)cudaMemcpyFlagPreferOverlapWithCompute);
}
CU
nvcc -o /tmp/attrs /tmp/attrs.cu 2>&1 | tail -3 && /tmp/attrs
python3 -m pytest -q -p no:cacheprovider -rA -s tests/test_transfer_cuda.py tests/test_transfer_scenarios.py \
    "tests/test_integrity.py::test_churn_on_cuda_with_pinned_host_tier" 2>&1 \
    | grep -v "^PASSED\|^SKIPPED" | tail -60
# (progress bars go to stderr: shown only if the bench fails)
python3 -m kvdist bench transfer 2>/tmp/bench.err || tail -20 /tmp/bench.err
