"""Block copies between the engine's KV tensors (``ExternalGpuTier``) and kvdist's host
and disk tiers when every tier is CPU-addressable: the handlers the CPU executors
(``SyncExecutor``, ``SimExecutor``) run, one per route, the same interface as
``kvdist.transfer.HostCopies``. A block moves as its pieces, one vectorized copy per
layer (one in all when the engine's layers lie in one allocation): the engine's
``[pieces, blocks, bytes]`` view of a layer against the host rows seen as ``[block,
layer, piece, bytes]`` (``ExternalGpuTier.gather``, ``scatter``).

A disk read that fails (an I/O error) leaves its engine blocks as they were and names
them to ``on_failed``: the engine recomputes them (``ExternalCache.failed_blocks``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..storage import DiskPool, HostPool
from ..transfer import DEMOTE, OFFLOAD, ONBOARD, PROMOTE, RELOAD, SPILL, HostCopies, Route
from .tier import ExternalGpuTier

__all__ = ["ExternalCopies"]


class ExternalCopies:
    """Copies of every route with the engine's tensors as the GPU tier."""

    def __init__(self, gpu: ExternalGpuTier, host: HostPool | None, disk: DiskPool | None,
                 on_failed: Callable[[list[int]], None] | None = None):
        self.gpu, self.host, self.disk = gpu, host, disk
        self._on_failed = on_failed
        self._cold = HostCopies(None, host, disk)  # demote and promote touch no GPU memory
        self._all = range(gpu.layout.num_layers)
        self._handlers: dict[Route, Callable[[list[int], list[int], range], None]] = {
            OFFLOAD: self._offload, ONBOARD: self._onboard, SPILL: self._spill, RELOAD: self._reload}

    @property
    def block_bytes(self) -> int:
        return self.gpu.layout.bytes_per_block

    def run(self, route: Route, src: list[int], dst: list[int], vectorized: bool) -> None:
        if route is DEMOTE or route is PROMOTE:
            self._cold.run(route, src, dst, vectorized)
        else:
            self._handlers[route](src, dst, self._all)

    def run_span(self, route: Route, src: list[int], dst: list[int], span: tuple[int, int]) -> None:
        """Bytes ``span`` of each block only (one layer group's layers)."""
        assert route in (OFFLOAD, ONBOARD), f"{route} is not copied by layer group"
        self._handlers[route](src, dst, self.gpu.layout.layers_in(span))

    @staticmethod
    def _index(slots: list[int]) -> torch.Tensor:
        return torch.tensor(slots, dtype=torch.int64)

    def _offload(self, src: list[int], dst: list[int], layers: range) -> None:
        self.gpu.gather(self._index(src), self.host.raw, layers, at=self._index(dst))

    def _onboard(self, src: list[int], dst: list[int], layers: range) -> None:
        self.gpu.scatter(self.host.raw[self._index(src)], self._index(dst), layers)

    def _spill(self, src: list[int], dst: list[int], layers: range) -> None:
        rows = torch.empty((len(src), self.block_bytes), dtype=torch.uint8)
        self.gpu.gather(self._index(src), rows, layers, at=torch.arange(len(src)))
        self.disk.write_blocks(dst, list(rows))

    def _reload(self, src: list[int], dst: list[int], layers: range) -> None:
        rows = torch.empty((len(src), self.block_bytes), dtype=torch.uint8)
        try:
            self.disk.read_blocks(src, list(rows))
        except OSError:
            if self._on_failed is None:
                raise
            self._on_failed(list(dst))
            return
        self.gpu.scatter(rows, self._index(dst), layers)
