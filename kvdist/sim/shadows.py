"""Bookkeeping-only replays of the run's trace: what GPU-only reuse and no reuse at
all would have saved on exactly the same requests, steps and GPU tier.

Each replay is a real kvdist cache on the CPU (``comm`` of one rank) with the run's
GPU capacity in blocks but a one-byte-per-token geometry, so it costs kilobytes
whatever the run's block size; no model runs, only the cache's bookkeeping. The
no-reuse replay also proves the trace fits without any reuse: the scheduler's
admission reserves worst-case blocks, and an OutOfBlocksError here would show it
did not."""

from __future__ import annotations

from dataclasses import dataclass

from ..cache import create
from ..config import CacheConfig
from .workload import Request

POLICIES = ("gpu-only", "no reuse")


@dataclass(slots=True)
class _Replay:
    name: str
    cache: object
    reused: int = 0


class Shadows:
    """The replays, driven step by step alongside the real run."""

    def __init__(self, cfg: CacheConfig, gpu_blocks: int, priority: int, comm=None):
        self.priority = priority
        self.replays: list[_Replay] = []
        for name, reuse in zip(POLICIES, (True, False)):
            shadow_cfg = cfg.replace(
                model={"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "dtype": "uint8"},
                cache={"device": "cpu", "gpu": {"blocks": gpu_blocks, "bytes": None,
                                                "memory_fraction": None},
                       "host": {"bytes": 0}, "disk": {"bytes": 0, "path": None},
                       "enable_reuse": reuse, "simulate_async": False})
            self.replays.append(_Replay(name, create(shadow_cfg, comm=comm)))

    def step(self, prefills: list[Request], appends: list[tuple[int, int]], finished: list[int]) -> None:
        """Replay one step: admitted requests, ``(rid, token)`` decode appends, then the
        releases of the requests that finished."""
        for r in self.replays:
            c = r.cache
            c.begin_step()
            for req in prefills:
                r.reused += c.add_sequence(req.rid, req.prompt.tolist(), self.priority)
            for rid, token in appends:
                c.append_tokens(rid, [token])
            c.end_step()
            for rid in finished:
                c.release(rid)

    def reused(self) -> dict[str, int]:
        return {r.name: r.reused for r in self.replays}

    def close(self) -> None:
        for r in self.replays:
            r.cache.close()
