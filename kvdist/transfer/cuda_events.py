"""The events the CUDA executor hands the transfer engine, besides plain CUDA events:
``Grouped`` (a batch copied one layer group after the other, an event per group) and
``DiskOp`` (a disk batch: a worker's future, and the CUDA event of its GPU half if it
has one). ``whole(e)`` is the CUDA event standing for all of an event's copies."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from .routes import RELOAD, Route

__all__ = ["DiskOp", "Grouped", "whole"]


@dataclass(slots=True, eq=False)
class Grouped:
    """The event of a batch copied one layer group at a time: ``events[g]`` completes
    once group g of every block has landed (and every group before it)."""

    events: list

    @property
    def last(self):
        return self.events[-1]

    def query(self) -> bool:
        return self.last.query()

    def synchronize(self) -> None:
        self.last.synchronize()


def whole(e):
    """The CUDA event standing for all of ``e``'s copies."""
    return e.last if isinstance(e, Grouped) else e


@dataclass(slots=True, eq=False)
class DiskOp:
    """The event of one disk batch. ``future``: the worker's part (the disk I/O and
    the host/bounce memory it touches). ``gpu_event``: the part that touches GPU
    memory (spill: GPU -> bounce done; reload: bounce -> GPU, queued once the read is
    done), None for a demotion."""

    route: Route
    future: Future
    buffer: torch.Tensor | None = None  # the bounce (its first rows), given back once the batch is complete
    gpu_event: torch.cuda.Event | Grouped | None = None
    gpu_slots: np.ndarray | None = None  # reload: where the GPU half writes
    gpu_deps: list = field(default_factory=list)  # reload: what the GPU half waits for

    @property
    def gpu_pending(self) -> bool:
        """A reload whose GPU half is not queued yet."""
        return self.route is RELOAD and self.gpu_event is None
