#!/usr/bin/env bash
# First look at the H200: versions, cudaMemcpyBatchAsync, copy ceilings, pinning speed,
# and the foundation's CUDA integrity test. Run from the repo root on the device machine.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import sys,torch; print(sys.version); print('torch', torch.__version__, torch.version.cuda)"
python3 - <<'PY'
import importlib.metadata as md
for p in ("cuda-bindings", "cuda-python", "cupy-cuda13x", "numpy"):
    try: print(p, md.version(p))
    except Exception as e: print(p, "missing")
from cuda.bindings import runtime as rt
print("has cudaMemcpyBatchAsync:", hasattr(rt, "cudaMemcpyBatchAsync"))
if hasattr(rt, "cudaMemcpyBatchAsync"):
    print(rt.cudaMemcpyBatchAsync.__doc__)
print("runtime version", rt.cudaRuntimeGetVersion())
print([n for n in dir(rt) if "MemcpyAttributes" in n or "MemcpySrcAccess" in n or "cudaMemcpyFlags" in n])
PY
which mpiexec; timeout 60 mpiexec -n 2 python3 -c "from mpi4py import MPI; print('mpi ok', MPI.COMM_WORLD.rank, MPI.Get_library_version()[:30])" 2>&1 | tail -3
python3 - <<'PY'
import time, torch
dev = torch.device("cuda")
def bw(fn, nbytes, reps=5):
    fn(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps): fn()
    torch.cuda.synchronize()
    return nbytes * reps / (time.perf_counter() - t) / 1e9
n = 2048; bs = 128 * 1024
h = torch.empty(n * bs, dtype=torch.uint8, pin_memory=True); h.fill_(1)
g = torch.empty(n * bs, dtype=torch.uint8, device=dev)
print(f"contiguous H2D {bw(lambda: g.copy_(h, non_blocking=True), n*bs):.1f} GB/s, "
      f"D2H {bw(lambda: h.copy_(g, non_blocking=True), n*bs):.1f} GB/s")
hb = h.view(n, bs); gb = g.view(n, bs)
perm = torch.randperm(n).tolist()
def loop():
    for i, j in enumerate(perm): gb[j].copy_(hb[i], non_blocking=True)
print(f"per-block H2D loop 128KiB {bw(loop, n*bs):.1f} GB/s")
t = time.perf_counter(); x = torch.empty(4 << 30, dtype=torch.uint8, pin_memory=True); dt = time.perf_counter() - t
print(f"torch.empty(pin_memory=True) 4 GiB: {dt:.2f} s = {4*1.074/dt:.2f} GB/s"); del x
PY
python3 -m pytest -q -p no:cacheprovider tests/test_integrity.py -k cuda -s 2>&1 | tail -5
