"""Building one rank's cache candidate: device selection, capacity planning, the
tier pools, the copy backend, the manager and the stager. A candidate owns every
resource it allocated until ``teardown()``, which frees them all (also after a
partial build)."""

from __future__ import annotations

import logging

import torch

from . import faults
from .backend import make_backend
from .config import CacheConfig
from .errors import ConfigError
from .layout import KVLayout
from .manager import CacheManager
from .rank_cache import RankCache
from .seams import Seams
from .staging import Stager
from .storage import DiskPool, GpuPool, HostPool
from .storage.host_sizing import auto_host_bytes, available_memory

__all__ = ["CandidateBuilder", "RankCache", "build_candidate", "cuda_free_bytes", "plan_capacity",
           "select_device"]

log = logging.getLogger("kvdist.candidate")


def select_device(spec: str, local_rank: int = 0) -> torch.device:
    """The GPU tier's device: ``auto`` is ``cuda:<node-local rank mod GPU count>`` when
    CUDA exists, else ``cpu``. Engines embedding kvdist can reuse this."""
    if spec == "cpu":
        return torch.device("cpu")
    has_cuda = torch.cuda.is_available()
    if spec == "auto":
        if not has_cuda:
            return torch.device("cpu")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if not has_cuda:
        raise ConfigError("cache.device", spec, "CUDA is not available on this machine")
    dev = torch.device(spec)
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError("cache.device", spec,
                          f"this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def cuda_free_bytes(device: torch.device) -> int:
    """Bytes this process can allocate on ``device``: the driver's free memory and what
    torch's caching allocator holds unused (a cache closed earlier in this process, an
    earlier run's activations), which an allocation takes before asking the driver."""
    return int(torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
               - torch.cuda.memory_allocated(device))


def _blocks(key: str, nbytes: int, layout: KVLayout) -> int:
    n = layout.blocks_in(nbytes)
    if nbytes and n == 0:
        raise ConfigError(key, nbytes, f"smaller than one block ({layout.bytes_per_block} bytes)")
    return n


def plan_capacity(cfg: CacheConfig, layout: KVLayout, device: torch.device,
                  local_ranks: int = 1) -> tuple[int, int, int]:
    """Blocks per tier (gpu, host, disk) this rank would allocate."""
    c = cfg.cache
    free = cuda_free_bytes(device) if device.type == "cuda" else available_memory() // max(local_ranks, 1)
    if c.gpu.blocks is not None:
        gpu = c.gpu.blocks
    elif c.gpu.bytes is not None:
        gpu = _blocks("cache.gpu.bytes", c.gpu.bytes, layout)
    else:
        gpu = _blocks("cache.gpu.memory_fraction", int(free * c.gpu.memory_fraction), layout)
    if gpu * layout.bytes_per_block > free:
        key, value = (("cache.gpu.blocks", c.gpu.blocks) if c.gpu.blocks is not None
                      else ("cache.gpu.bytes", c.gpu.bytes))
        where = (f"{device} has free" if device.type == "cuda"
                 else f"this node has available for each of its {local_ranks} rank(s)")
        raise ConfigError(key, value, f"{gpu * layout.bytes_per_block:,} bytes, more than the "
                                      f"{free:,} bytes {where}")
    if c.host.bytes == "auto":
        size = auto_host_bytes(gpu * layout.bytes_per_block, max(local_ranks, 1),
                               memory_fraction=c.host.auto_memory_fraction,
                               gpu_ratio=c.host.auto_gpu_ratio, pinned=device.type == "cuda",
                               check_memlock=c.host.check_memlock)
        log.info("%s", size.describe())
        host = layout.blocks_in(size.nbytes)
    else:
        host = _blocks("cache.host.bytes", c.host.bytes, layout)
        node = available_memory()
        if c.host.bytes > node:  # no rank could have it: a mistake, like a GPU tier's or disk's too large
            raise ConfigError("cache.host.bytes", c.host.bytes,
                              f"more than the {node:,} bytes this node has available (MemAvailable)")
    disk = _blocks("cache.disk.bytes", c.disk.bytes, layout) if c.disk.path else 0
    return gpu, host, disk


def build_candidate(cfg: CacheConfig, capacity: tuple[int, int, int], device: torch.device,
                    rank: int, *, with_host: bool = True, fallback: bool = False,
                    seams: Seams | None = None, host_shared_path: str | None = None,
                    events_replica: int | None = None) -> RankCache:
    """Allocate the tiers, the copy backend, the manager and the stager. ``with_host=False``
    is the rebuild after USE_NO_HOST (the disk tier is kept). ``host_shared_path``: keep
    the host tier in that shared-memory file (the remote tier's peers on the node map
    it). ``events_replica``: this rank publishes that replica's KV cache events (when
``cache.events.enabled``). On any error everything allocated so far is freed before
the error propagates."""
    layout = KVLayout.from_config(cfg)
    seams = seams or Seams()
    local = RankCache(cfg, layout, device)
    try:
        faults.inject("fallback_build" if fallback else "build", rank)
        gpu_n, host_n, disk_n = capacity
        if not with_host:
            host_n = 0
        local.gpu = GpuPool(layout, gpu_n, device)
        if host_n:
            faults.inject("host_tier", rank)
            h = cfg.cache.host
            local.host = HostPool(layout, host_n, pin=device.type == "cuda", device=device,
                                  chunk_bytes=h.chunk_bytes, prefault_threads=h.prefault_threads,
                                  check_memlock=h.check_memlock, huge_pages=h.huge_pages, rank=rank,
                                  shared_path=host_shared_path)
        if disk_n:
            d = cfg.cache.disk
            local.disk = DiskPool(layout, disk_n, d.path, rank, io_threads=d.io_threads,
                                  o_direct=d.o_direct, max_read_bytes_per_s=d.max_read_bytes_per_s)
        local.backend = make_backend(cfg, device, local.gpu, local.host, local.disk,
                                     copy_path=seams.copy_path, log=seams.batch_log)
        local.manager = CacheManager(
            layout, (gpu_n, host_n, disk_n), local.backend.executor,
            enable_reuse=cfg.cache.enable_reuse,
            offload_min_priority=cfg.cache.offload_min_priority,
            demote_ahead=int(cfg.cache.disk.demote_ahead * host_n),
            drop_behind_disk=cfg.cache.disk.drop_behind,
            engine_seams=seams.engine_seams(), table_rows=seams.table_rows,
            recompute_when_faster=cfg.cache.recompute_when_faster)
        local.stager = Stager(local.backend.upload, slots=seams.staging_slots, protect=seams.protect_staging)
        if cfg.cache.events.enabled and events_replica is not None:
            try:
                from .events.channel import KVEvents
            except ImportError as e:
                raise ConfigError("cache.events.enabled", True,
                                  f"needs the events extra: pip install 'kvdist[events]' ({e})") from None
            local.events = KVEvents(cfg.cache.events, events_replica, local.manager)
        seams.rank_cache = local
        return local
    except BaseException:
        local.teardown()
        raise


class CandidateBuilder:
    """This rank's side of the start-up protocol (``kvdist.distributed.consensus.Builder``):
    ``plan`` picks the device and the capacity it could allocate (no allocation),
    ``build`` allocates a candidate of the capacity all ranks agreed on."""

    def __init__(self, cfg: CacheConfig, rank: int, local_rank: int = 0, local_size: int = 1,
                 seams: Seams | None = None, host_shared_path: str | None = None,
                 events_replica: int | None = None):
        self.cfg = cfg
        self.events_replica = events_replica  # the replica whose events this rank publishes
        self.host_shared_path = host_shared_path
        self.rank = rank
        self.local_rank = local_rank
        self.local_size = local_size
        self.seams = seams
        self.layout = KVLayout.from_config(cfg)
        self.device: torch.device | None = None

    def plan(self) -> tuple[int, int, int]:
        self.device = select_device(self.cfg.cache.device, self.local_rank)
        return plan_capacity(self.cfg, self.layout, self.device, self.local_size)

    def build(self, capacity: tuple[int, int, int], *, with_host: bool, fallback: bool) -> RankCache:
        assert self.device is not None, "plan() before build()"
        return build_candidate(self.cfg, capacity, self.device, self.rank, with_host=with_host,
                               fallback=fallback, seams=self.seams, host_shared_path=self.host_shared_path,
                               events_replica=self.events_replica)
