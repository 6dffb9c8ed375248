"""Bookkeeping-only replays of the run's trace: what GPU-only reuse and no reuse at
all would have saved on exactly the same requests, steps and GPU tier.

Each replay is a real kvdist cache on the CPU (``comm`` of one rank) with the run's
capacities in blocks but a one-byte-per-token geometry, so it costs kilobytes
whatever the run's block size; no model runs, only the cache's bookkeeping. The
no-reuse replay also proves the trace fits without any reuse: the scheduler's
admission reserves worst-case blocks, and an OutOfBlocksError here would show it
did not."""

from __future__ import annotations

from dataclasses import dataclass

from ...cache import KVCache, create
from ...config import CacheConfig
from ...layout import KVLayout
from .workload import Request

POLICIES = ("gpu-only", "no reuse")


def bookkeeping_cache(cfg: CacheConfig, *, gpu: int, host: int = 0, disk: int = 0,
                      disk_dir: str | None = None, reuse: bool = True, comm=None) -> KVCache:
    """A cache of ``gpu``/``host``/``disk`` blocks of one byte per token on the CPU:
    the run's decisions at a size of kilobytes. One replica, no remote tier, no KV cache
    events; its disk file (when ``disk``) goes to ``disk_dir``."""
    assert not disk or disk_dir, "a disk tier needs a directory"
    model = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "dtype": "uint8"}
    bpb = KVLayout(**model, tokens_per_block=cfg.cache.tokens_per_block).bytes_per_block
    # One replace, every tier given: the run's own tiers are never validated again here
    # (its disk tier, re-checked against the space it now fills, would refuse itself on
    # this rank alone while the others wait).
    return create(cfg.replace(
        model=model,
        cache={"device": "cpu", "gpu": {"blocks": gpu, "bytes": None, "memory_fraction": None},
               "host": {"bytes": host * bpb},
               "disk": {"bytes": disk * bpb, "path": disk_dir if disk else None},
               "enable_reuse": reuse, "simulate_async": False,
               "events": {"enabled": False}},  # the run's cache publishes: a replay would bind its port again
        distributed={"tp_size": 0, "remote": {"enabled": False}}), comm=comm)


def replay_step(cache: KVCache, prefills: list[Request], appends: list[tuple[int, int]],
                finished: list[int], priority: int) -> int:
    """One scheduler step through a bookkeeping cache: admitted requests, ``(rid,
    token)`` decode appends, then the releases of the requests that finished.
    Returns the prompt tokens reused."""
    cache.begin_step()
    reused = sum(cache.add_sequence(req.rid, req.prompt.tolist(), priority) for req in prefills)
    for rid, token in appends:
        cache.append_tokens(rid, [token])
    cache.end_step()
    for rid in finished:
        cache.release(rid)
    return reused


@dataclass(slots=True)
class _Replay:
    name: str
    cache: KVCache
    reused: int = 0


class Shadows:
    """The replays, driven step by step alongside the real run."""

    def __init__(self, cfg: CacheConfig, gpu_blocks: int, priority: int, comm=None):
        self.priority = priority
        self.replays = [_Replay(name, bookkeeping_cache(cfg, gpu=gpu_blocks, reuse=reuse, comm=comm))
                        for name, reuse in zip(POLICIES, (True, False))]

    def step(self, prefills: list[Request], appends: list[tuple[int, int]], finished: list[int]) -> None:
        for r in self.replays:
            r.reused += replay_step(r.cache, prefills, appends, finished, self.priority)

    def reused(self) -> dict[str, int]:
        return {r.name: r.reused for r in self.replays}

    def close(self) -> None:
        for r in self.replays:
            r.cache.close()
