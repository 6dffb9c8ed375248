"""The parts of one rank's cache as built (``kvdist.candidate.build_candidate``): pools,
copy backend, manager and stager. Its own module so that the test seams can name it
without importing the builder that takes them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .backend import CopyBackend
from .config import CacheConfig
from .layout import KVLayout
from .manager import CacheManager
from .staging import Stager
from .storage import DiskPool, GpuPool, HostPool

if TYPE_CHECKING:
    from .events.channel import KVEvents

__all__ = ["RankCache"]


@dataclass(slots=True)
class RankCache:
    """The parts of one rank's cache: pools, copy backend, manager and stager, plus how
    they were built. A candidate until the ranks commit it; then what KVCache drives."""

    cfg: CacheConfig
    layout: KVLayout
    device: torch.device
    gpu: GpuPool | None = None
    host: HostPool | None = None
    disk: DiskPool | None = None
    backend: CopyBackend | None = None
    manager: CacheManager | None = None
    stager: Stager | None = None  # host->device metadata copies (rule S3)
    events: KVEvents | None = None  # the replica's KV cache events (TP rank 0, cache.events.enabled)

    def teardown(self) -> None:
        """Free every tier (idempotent, safe after a partial build)."""
        if self.events is not None:
            self.events.close()
            self.events = None
        if self.manager is not None:
            try:
                self.manager.synchronize()
            finally:
                self.manager = None
        if self.stager is not None:
            self.stager.close()
            self.stager = None
        if self.backend is not None:
            self.backend.executor.close()  # the CUDA executor's disk workers
            self.backend = None
        for pool in (self.disk, self.host, self.gpu):
            if pool is not None:
                pool.close()
        self.disk = self.host = self.gpu = None

    @property
    def tiers(self) -> tuple[str, ...]:
        return self.manager.tier_names()
