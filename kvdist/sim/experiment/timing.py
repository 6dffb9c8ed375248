"""Time measured around a step, not inside it: the cache's calls each timed on their
own (``TimedCache``, a thin front of the cache the step loop calls through), and the
step's phases (``StepTimes``: the cache's part of the step, the model's, the checks'
pause). The step's code reads no timer."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from ...cache import KVCache

__all__ = ["CACHE_CALLS", "StepTimes", "TimedCache"]

# The cache calls of a step, each timed on its own (results: cache_calls_us_per_step).
CACHE_CALLS = ("begin_step", "add_sequence", "prefetch", "append_tokens", "block_table", "end_step",
               "release")

T = TypeVar("T")


@dataclass(slots=True)
class StepTimes:
    """Seconds summed over the run's steps."""

    cache_api: float = 0.0  # the step outside the model's forward pass and the checks
    model: float = 0.0  # the forward pass until the step's first tokens are on the host
    calls: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CACHE_CALLS, 0.0))
    started: float = field(default_factory=time.perf_counter)
    idle: float = 0.0  # waiting for arrivals, closing steps that ran nothing
    # The critical path (steps that ran a batch): their wall time less the checks' pause,
    # the device's time in their forward passes (CUDA events; on CPU the host's), and the
    # cache's host time the device waited for.
    steps_run: int = 0
    step_wall: float = 0.0
    gpu_busy: float = 0.0
    cache_critical: float = 0.0

    def count(self, wall: float, cache_critical: float) -> None:
        """A step that ran a batch took ``wall`` seconds, ``cache_critical`` of them the
        cache's with the device waiting."""
        self.steps_run += 1
        self.step_wall += wall
        self.cache_critical += min(cache_critical, wall)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the time of the ``with`` body to ``name`` (``cache_api`` or ``model``)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, name, getattr(self, name) + time.perf_counter() - t0)


class TimedCache:
    """The cache calls a step makes, each adding its time to ``times.calls``."""

    def __init__(self, cache: KVCache, times: StepTimes):
        self.cache, self._calls = cache, times.calls

    def _timed(self, name: str, call: Callable[[], T]) -> T:
        t0 = time.perf_counter()
        try:
            return call()
        finally:
            self._calls[name] += time.perf_counter() - t0

    def begin_step(self) -> None:
        self._timed("begin_step", self.cache.begin_step)

    def add_sequence(self, seq_id: Hashable, tokens: list[int], priority: int) -> int:
        return self._timed("add_sequence", lambda: self.cache.add_sequence(seq_id, tokens, priority))

    def prefetch(self, seq_id: Hashable, tokens: list[int]) -> int:
        return self._timed("prefetch", lambda: self.cache.prefetch(seq_id, tokens))

    def prefetch_ready(self, seq_id: Hashable) -> bool:
        """Not timed: a lookup, agreed at ``end_step``."""
        return self.cache.prefetch_ready(seq_id)

    def append_tokens(self, appends: list[tuple[int, int]]) -> None:
        """Append one decoded token to each sequence (one figure for all of them)."""
        def run() -> None:
            for seq_id, token in appends:
                self.cache.append_tokens(seq_id, [token])
        self._timed("append_tokens", run)

    def block_table(self, seq_ids: list[int]) -> torch.Tensor:
        return self._timed("block_table", lambda: self.cache.block_table(seq_ids))

    def end_step(self) -> None:
        self._timed("end_step", self.cache.end_step)

    def release(self, seq_ids: list[int]) -> None:
        def run() -> None:
            for seq_id in seq_ids:
                self.cache.release(seq_id)
        self._timed("release", run)
