"""Start-up of a worker rank with ``cache.gpu: external``: the start-up consensus
(docs/design.md, "Start-up") over kvdist's host and disk tiers alone. Every rank plans
the tiers the config gives (the same on every rank: the planner numbers its slots from
the config), builds them, and the ranks agree as ever: a rank that cannot pin its host
tier makes every rank drop theirs (USE_NO_HOST), and ``ExternalCache.tier_plan`` then
says so, for the planner. The engine's tensors come later (``ExternalCache.register``)."""

from __future__ import annotations

import torch

from .. import faults
from ..candidate import select_device
from ..config import CacheConfig, load_config
from ..distributed import comm as dist_comm
from ..distributed.consensus import InitTiming, establish
from ..errors import ConfigError
from ..layout import KVLayout
from ..seams import Seams
from ..storage import DiskPool, HostPool
from .cache import ExternalCache, ExternalTiers
from .peers_setup import commit_peers, sharing
from .planner import tier_plan

__all__ = ["ExternalBuilder", "create"]


class ExternalBuilder:
    """This rank's side of the start-up protocol for kvdist's tiers beside an engine's
    GPU (``kvdist.distributed.consensus.Builder``)."""

    def __init__(self, cfg: CacheConfig, rank: int, device: torch.device, host_path: str | None = None):
        """``host_path``: the shared-memory file of the host tier (peer replicas on this
        node read it: ``peers_setup.sharing``), None for private memory."""
        self.cfg, self.rank, self.device, self.host_path = cfg, rank, device, host_path
        self.layout = KVLayout.from_config(cfg)

    def plan(self) -> tuple[int, int, int]:
        tiers = tier_plan(self.cfg)
        c = self.cfg.cache
        if c.host.bytes and not tiers.host_blocks:
            raise ConfigError("cache.host.bytes", c.host.bytes,
                              f"smaller than one block ({self.layout.bytes_per_block} bytes)")
        if c.disk.path and c.disk.bytes and not tiers.disk_blocks:
            raise ConfigError("cache.disk.bytes", c.disk.bytes,
                              f"smaller than one block ({self.layout.bytes_per_block} bytes)")
        return 0, tiers.host_blocks, tiers.disk_blocks

    def build(self, capacity: tuple[int, int, int], *, with_host: bool, fallback: bool) -> ExternalTiers:
        out = ExternalTiers()
        try:
            faults.inject("fallback_build" if fallback else "build", self.rank)
            _, host_n, disk_n = capacity
            if host_n and with_host:
                faults.inject("host_tier", self.rank)
                h = self.cfg.cache.host
                out.host = HostPool(self.layout, host_n, pin=self.device.type == "cuda", device=self.device,
                                    chunk_bytes=h.chunk_bytes, prefault_threads=h.prefault_threads,
                                    check_memlock=h.check_memlock, huge_pages=h.huge_pages, rank=self.rank,
                                    shared_path=self.host_path if not fallback else None)
            if disk_n:
                d = self.cfg.cache.disk
                out.disk = DiskPool(self.layout, disk_n, d.path, self.rank, io_threads=d.io_threads,
                                    o_direct=d.o_direct, max_read_bytes_per_s=d.max_read_bytes_per_s)
            return out
        except BaseException:
            out.teardown()
            raise


def create(cfg: CacheConfig | dict | str, comm=None, device: torch.device | str | None = None,
           seams: Seams | None = None) -> ExternalCache:
    """Build kvdist's tiers on every worker rank of ``comm`` (collective; ``None`` as in
    ``kvdist.create``). ``device``: the engine's GPU (default: ``cache.device`` as
    ``kvdist.create`` picks it); the host tier is pinned for it. Register the engine's
    KV tensors next (``ExternalCache.register``)."""
    cfg = load_config(cfg)
    if cfg.cache.gpu != "external":
        raise ConfigError("cache.gpu", "a size", "kvdist.external.create is for cache.gpu: external "
                                                 "(kvdist.create builds kvdist's own GPU tier)")
    timing = InitTiming()
    c = dist_comm.resolve(comm, cfg.distributed.consensus_timeout_s)
    share = None
    try:
        dev = torch.device(device) if device is not None else select_device(cfg.cache.device, c.local_rank)
        share = sharing(c, cfg)
        path = share.plan.host_path if share.plan is not None else None
        done = establish(c, cfg, ExternalBuilder(cfg, c.rank, dev, path), timing)
        rules = seams.remote_rules if seams is not None else None
        peers = commit_peers(c, share, cfg, done.status, done.candidate.host, dev, rules)
    except BaseException:
        if share is not None:
            share.replicas.free()
        c.free()
        raise
    step = cfg.distributed.step_timeout_s
    c.run_time(None if step == "auto" else step)
    if share.replicas.tp is not c:
        share.replicas.tp.run_time(None if step == "auto" else step)
    return ExternalCache(cfg, done.candidate, c, dev, done, seams, replicas=share.replicas, peers=peers)
