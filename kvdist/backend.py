"""The copy machinery of one rank, chosen once from its device: the executor that moves
blocks between tiers (``kvdist.transfer``) and the upload path that stages metadata for
the device (``kvdist.staging``). The two must match, since a simulated executor's
uploads queue on its own simulated streams, so one factory builds both.

=============================  ===================  ==============
device / setting               executor             upload path
=============================  ===================  ==============
cuda                           ``CudaExecutor``     ``CudaH2D``
cpu, ``simulate_async``        ``SimExecutor``      ``SimH2D``
cpu                            ``SyncExecutor``     ``ImmediateH2D``
=============================  ===================  =============="""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .config import CacheConfig
from .errors import ConfigError
from .staging import CudaH2D, ImmediateH2D, SimH2D, Upload
from .storage import DiskPool, GpuPool, HostPool
from .transfer import BatchLog, Executor, HostCopies, SimExecutor, SyncExecutor

__all__ = ["CopyBackend", "copy_path_override", "make_backend", "simulate_async"]


@dataclass(frozen=True, slots=True)
class CopyBackend:
    executor: Executor
    upload: Upload


def simulate_async(cfg: CacheConfig) -> bool:
    """``cache.simulate_async``, or ``KVDIST_SIMULATE_ASYNC=1`` in the environment."""
    env = os.environ.get("KVDIST_SIMULATE_ASYNC", "")
    if env not in ("", "0", "1"):
        raise ConfigError("KVDIST_SIMULATE_ASYNC", env, "must be 0 or 1")
    return cfg.cache.simulate_async or env == "1"


def copy_path_override() -> str | None:
    """``KVDIST_COPY_PATH`` forces the CUDA copy path (benchmarks, diagnosis)."""
    from .transfer.batchcopy import PATHS

    env = os.environ.get("KVDIST_COPY_PATH", "")
    if env and env not in PATHS:
        raise ConfigError("KVDIST_COPY_PATH", env, f"must be one of {', '.join(PATHS)}")
    return env or None


def make_backend(cfg: CacheConfig, device: torch.device, gpu: GpuPool, host: HostPool | None,
                 disk: DiskPool | None, *, copy_path: str | None = None,
                 log: BatchLog | None = None) -> CopyBackend:
    """The executor and upload path for a cache on ``device`` over these pools.
    ``copy_path`` forces the CUDA copy path (else ``KVDIST_COPY_PATH``, else the fastest);
    ``log`` records every submitted batch (tests)."""
    layout = gpu.layout  # copied by layer group (S5 per layer)
    groups = layout.layer_groups(layout.groups_for(cfg.cache.layer_groups, cfg.cache.min_copy_piece))
    if device.type == "cuda":
        from .transfer.cuda import CudaExecutor

        executor = CudaExecutor(gpu, host, disk, device, path=copy_path or copy_path_override(), log=log,
                                groups=groups)
        return CopyBackend(executor, CudaH2D(device))
    copies = HostCopies(gpu, host, disk)
    if simulate_async(cfg):
        sim = SimExecutor(copies, log=log, groups=groups)
        return CopyBackend(sim, SimH2D(sim))
    return CopyBackend(SyncExecutor(copies, log=log), ImmediateH2D())
