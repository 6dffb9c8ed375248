"""What this machine offers kvdist's batched copies: torch and CUDA versions, the copier's
view (``BatchCopier.describe()``), whether cuda-bindings has ``cudaMemcpyBatchAsync``,
and the ctypes layout of ``cudaMemcpyAttributes`` (compare with memcpy_attrs.cu, which
prints the header's). Usage: python3 scripts/gpu/memcpy_attrs.py"""

from __future__ import annotations

import ctypes

import torch

from kvdist.transfer import batchcopy


def main() -> None:
    print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
    print("cuda-bindings", batchcopy.bindings_version())
    try:
        from cuda.bindings import runtime as rt

        print("cuda.bindings.runtime has cudaMemcpyBatchAsync:", hasattr(rt, "cudaMemcpyBatchAsync"))
        print("  runtime version via bindings:", rt.cudaRuntimeGetVersion())
    except ImportError as e:
        print("cuda.bindings:", type(e).__name__, e)
    copier = batchcopy.BatchCopier(torch.device("cuda"))
    print("kvdist copier:", copier.describe())
    print("loaded libcudart has cudaMemcpyBatchAsync:", hasattr(copier.lib, "cudaMemcpyBatchAsync"))
    attrs = batchcopy._MemcpyAttributes
    print("ctypes cudaMemcpyAttributes: size", ctypes.sizeof(attrs), "offsets",
          [getattr(attrs, f).offset for f, _ in attrs._fields_])


if __name__ == "__main__":
    main()
