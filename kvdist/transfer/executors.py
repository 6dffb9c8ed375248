"""Executors for a cache whose GPU tier lives in host memory (``device: cpu``):
the copy kernels, and the executor that runs each batch at once."""

from __future__ import annotations

import numpy as np
import torch

from ..storage import DiskPool, GpuPool, HostPool


class HostCopies:
    """Block copies between the tiers when every tier is CPU-addressable.
    ``run`` applies the copies of one batch in the order given."""

    def __init__(self, gpu: GpuPool, host: HostPool | None, disk: DiskPool | None):
        self.gpu, self.host, self.disk = gpu, host, disk

    def run(self, direction: str, src: list[int], dst: list[int], vectorized: bool) -> None:
        g = self.gpu.raw
        h = self.host.raw if self.host is not None else None
        if direction in ("offload", "onboard"):
            a, b = (g, h) if direction == "offload" else (h, g)
            if vectorized:
                b.index_copy_(0, torch.tensor(dst), a.index_select(0, torch.tensor(src)))
            else:
                for s, d in zip(src, dst):
                    b[d].copy_(a[s])
        elif direction in ("demote", "spill"):
            # One batched call: the disk pool spreads it over its I/O threads.
            a = h if direction == "demote" else g
            self.disk.write_blocks(dst, [a[s] for s in src])
        elif direction == "fetch":
            self.disk.read_blocks(src, [g[d] for d in dst])
        else:
            raise AssertionError(f"unknown direction {direction}")


class _Done:
    """The event of work that has already run."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "DONE"


DONE = _Done()


class SyncExecutor:
    """Runs every batch the moment it is submitted; every event is already complete."""

    path = "sync"

    def __init__(self, copies: HostCopies):
        self.copies = copies

    def submit(self, stream: str, direction: str, src, dst, deps: list):
        self.copies.run(direction, np.asarray(src).tolist(), np.asarray(dst).tolist(), vectorized=True)
        return DONE

    def record_compute(self):
        return None

    def compute_wait(self, events: list) -> None:
        pass

    def synchronize(self) -> None:
        pass

    @staticmethod
    def is_done(event) -> bool:
        return True


class NullExecutor(SyncExecutor):
    """Copies nothing, every event complete at once: the bookkeeping alone (benchmarks
    and reference-model tests of the manager, with no memory behind the slots)."""

    path = "none"

    def __init__(self) -> None:
        pass

    def submit(self, stream: str, direction: str, src, dst, deps: list):
        return DONE
