"""Block copies between the engine's KV tensors (``ExternalGpuTier``) and kvdist's host
and disk tiers when every tier is CPU-addressable: the handlers the CPU executors
(``SyncExecutor``, ``SimExecutor``) run, one per route, the same interface as
``kvdist.transfer.HostCopies``. A block moves as its pieces, one vectorized copy per
layer: the engine's ``[2, blocks, piece]`` view of a layer against the host rows seen
as ``[block, layer, k|v, piece]``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..storage import DiskPool, HostPool
from ..transfer import DEMOTE, OFFLOAD, ONBOARD, PROMOTE, RELOAD, SPILL, HostCopies, Route
from .tier import ExternalGpuTier

__all__ = ["ExternalCopies"]


class ExternalCopies:
    """Copies of every route with the engine's tensors as the GPU tier."""

    def __init__(self, gpu: ExternalGpuTier, host: HostPool | None, disk: DiskPool | None):
        self.gpu, self.host, self.disk = gpu, host, disk
        self._cold = HostCopies(None, host, disk)  # demote and promote touch no GPU memory
        layout = gpu.layout
        self._all = range(layout.num_layers)
        pieces = gpu.pieces_of
        self._shape = (layout.num_layers, pieces.per_layer, pieces.piece_bytes)
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

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.view(rows.shape[0], *self._shape)

    def gather(self, blocks: list[int], rows: torch.Tensor, layers: range,
               at: list[int] | None = None) -> None:
        """``rows[at[i]]`` (kvdist block bytes; ``at`` None: ``rows[i]``) <- the pieces
        of engine block ``blocks[i]``."""
        idx = torch.tensor(blocks, dtype=torch.int64)
        out = self._rows(rows)
        where = torch.arange(len(blocks)) if at is None else torch.tensor(at, dtype=torch.int64)
        for layer in layers:
            out[where, layer] = self.gpu.pieces(layer)[:, idx].transpose(0, 1)

    def scatter(self, rows: torch.Tensor, blocks: list[int], layers: range) -> None:
        """The pieces of engine block ``blocks[i]`` <- ``rows[i]`` (kvdist block bytes)."""
        idx = torch.tensor(blocks, dtype=torch.int64)
        src = self._rows(rows)
        for layer in layers:
            self.gpu.pieces(layer)[:, idx] = src[:, layer].transpose(0, 1)

    def _offload(self, src: list[int], dst: list[int], layers: range) -> None:
        self.gather(src, self.host.raw, layers, at=dst)

    def _onboard(self, src: list[int], dst: list[int], layers: range) -> None:
        self.scatter(self.host.raw[torch.tensor(src, dtype=torch.int64)], dst, layers)

    def _spill(self, src: list[int], dst: list[int], layers: range) -> None:
        rows = torch.empty((len(src), self.block_bytes), dtype=torch.uint8)
        self.gather(src, rows, layers)
        self.disk.write_blocks(dst, list(rows))

    def _reload(self, src: list[int], dst: list[int], layers: range) -> None:
        rows = torch.empty((len(src), self.block_bytes), dtype=torch.uint8)
        self.disk.read_blocks(src, list(rows))
        self.scatter(rows, dst, layers)
