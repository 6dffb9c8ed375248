"""The CUDA executor with the engine's tensors as the GPU tier (``cache.gpu: external``)."""

from __future__ import annotations

from ..transfer.cuda import CudaExecutor

__all__ = ["ExternalCudaExecutor"]


class ExternalCudaExecutor(CudaExecutor):
    """Being written: copies a block as its pieces in the engine's per-layer tensors."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("cache.gpu: external on CUDA is being written")
