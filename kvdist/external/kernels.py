"""One kernel that scatters staged kvdist blocks into the engine's per-layer tensors, or
gathers them out, for every layer of a layer group at once (``staged`` copies of
``kvdist/external/cuda.py``, where the engine keeps each layer in an allocation of its
own: vLLM's default).

Torch's indexing moves a layer per kernel; a group of 32 layers is then 32 launches and
their host time per staging chunk, which at vLLM's TP 8 pieces (8 KiB a layer of a
16-token Llama-3-8B block) kept the staged path at half the copy engines' rate (H200,
2026-12-01: 28 / 55 GB/s onboard). Here one launch moves a chunk: program ``(i, l)``
copies block ``i``'s pieces of layer ``l`` as 8-byte words between the staging row and
the engine's block, whose address it reads from a table of the layers' base addresses
and byte strides (the tensors are separate allocations, so no single strided view
covers them).

Triton on CUDA only (``available``); elsewhere ``ExternalGpuTier``'s torch indexing
serves (CPU executors, the tests on CPU)."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch
    triton = None

__all__ = ["LayerTable", "available", "move_pieces"]

_WORDS = 1024  # 8-byte words a program moves per iteration (8 KiB)


def available(device: torch.device) -> bool:
    """Whether ``move_pieces`` runs on ``device`` (Triton on CUDA)."""
    return triton is not None and device.type == "cuda"


class LayerTable:
    """The engine's layers as the kernel addresses them: per layer its base address, its
    block stride and its piece stride in 8-byte words (int64 tensors on the device)."""

    def __init__(self, ptrs: list[int], block_strides: list[int], piece_strides: list[int],
                 piece_bytes: int, per_layer: int, device: torch.device):
        assert piece_bytes % 8 == 0 and all(p % 8 == 0 for p in ptrs), "pieces of whole 8-byte words"
        assert all(s % 8 == 0 for s in block_strides + piece_strides), "strides of whole 8-byte words"
        self.ptrs = torch.tensor(ptrs, dtype=torch.int64, device=device)
        self.block_words = torch.tensor([s // 8 for s in block_strides], dtype=torch.int64, device=device)
        self.piece_words = torch.tensor([s // 8 for s in piece_strides], dtype=torch.int64, device=device)
        self.words = piece_bytes // 8
        self.per_layer = per_layer


def move_pieces(table: LayerTable, stage: torch.Tensor, blocks: torch.Tensor, layers: range,
                to_engine: bool, row_layer0: int = 0) -> None:
    """Between ``stage`` (``[n, row bytes]`` uint8 rows, kvdist's block order: layer,
    piece, bytes; a row's first layer is ``row_layer0``: 0 for whole blocks,
    ``layers.start`` for rows of ``layers`` alone) and engine blocks ``blocks`` (``n``
    int64 ids on the device): ``layers`` of each, on the current stream."""
    n = int(blocks.numel())
    if n == 0 or len(layers) == 0:
        return
    assert stage.is_contiguous() and stage.dtype == torch.uint8 and stage.shape[0] >= n
    words = stage.view(torch.int64)
    grid = (n, len(layers))
    _move[grid](words, words.stride(0), table.ptrs, table.block_words, table.piece_words, blocks,
                layers.start, layers.start - row_layer0, table.words, PER_LAYER=table.per_layer,
                TO_ENGINE=to_engine, WORDS=_WORDS)


if triton is not None:
    @triton.jit
    def _move(stage, row_words, ptrs, block_words, piece_words, blocks, layer0, row0, words,
              PER_LAYER: tl.constexpr, TO_ENGINE: tl.constexpr, WORDS: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        layer = layer0 + tl.program_id(1).to(tl.int64)
        block = tl.load(blocks + i)
        base = tl.load(ptrs + layer).to(tl.pointer_type(tl.int64))
        engine = base + block * tl.load(block_words + layer)
        step = tl.load(piece_words + layer)
        row = stage + i * row_words + (row0 + tl.program_id(1).to(tl.int64)) * PER_LAYER * words
        w = tl.arange(0, WORDS)
        for p in tl.static_range(PER_LAYER):
            for start in range(0, words, WORDS):
                at = start + w
                mask = at < words
                if TO_ENGINE:
                    tl.store(engine + p * step + at, tl.load(row + p * words + at, mask=mask), mask=mask)
                else:
                    tl.store(row + p * words + at, tl.load(engine + p * step + at, mask=mask), mask=mask)
