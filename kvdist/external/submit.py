"""The order in which a worker rank hands one call's copies to the transfer engine
(``ExternalCache.start`` / ``save``): batches of at most ``SUBMIT_BYTES``, the loads'
first and the rest's in turns with them when the two touch no slot in common.

Why (``scripts/gpu/external_probe.py``; docs/design.md, "An engine-owned GPU tier"):
one host thread submits every copy, and handing a batch to the driver costs host time
per entry (``cudaMemcpyBatchAsync``: about 1.15 µs an entry on the H200, 2.3 ms for
2,048). A batch's copies start only once its call returns, and the engine submits one
batch per route: 1 GiB of saves at TP 8 (4,096 entries) kept the copy engines idle for
~4.7 ms before the first byte moved, and the loads of the same call waited behind all
of the saves' submission (another ~4.7 ms), so the two directions overlapped for only
part of the step. Cut into batches of ``SUBMIT_BYTES`` handed over in turns, the first
copies of both directions start within a batch's host time and the host stays ahead of
the copy engines (a 64 MiB batch moves in ~1.2 ms one way; its submission takes ~0.3 ms
at 256 KiB blocks). Loads go first: the compute stream waits for them, not for saves.

Reordering is safe only between copies that touch disjoint slots (S2 orders copies by
the order they are handed over): when the loads and the rest share a slot, every copy
keeps the planner's order, still cut into batches."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from ..blocks import GPU
from ..transfer import Route

__all__ = ["SUBMIT_BYTES", "submission"]

SUBMIT_BYTES = 64 << 20  # the bytes of one batch handed to the transfer engine, at most

Piece = tuple[Route, np.ndarray, np.ndarray]  # copies of one route, global slots


def _runs(routes: Sequence[Route], rid: np.ndarray, src: np.ndarray, dst: np.ndarray) -> list[Piece]:
    """Maximal runs of one route, in order; entries with ``rid < 0`` left out."""
    cuts = np.flatnonzero(rid[1:] != rid[:-1]) + 1 if len(rid) else rid
    out = []
    for lo, hi in zip(np.concatenate(([0], cuts)).tolist(), np.append(cuts, len(rid)).tolist()):
        if hi > lo and rid[lo] >= 0:
            out.append((routes[lo], src[lo:hi], dst[lo:hi]))
    return out


def _slices(runs: list[Piece], blocks: int) -> list[list[Piece]]:
    """``runs`` in order, cut into consecutive slices of at most ``blocks`` copies."""
    out: list[list[Piece]] = []
    room = 0
    for route, s, d in runs:
        at = 0
        while at < len(s):
            if room == 0:
                out.append([])
                room = blocks
            take = min(room, len(s) - at)
            out[-1].append((route, s[at:at + take], d[at:at + take]))
            at, room = at + take, room - take
    return out


def _touched(runs: list[Piece]) -> np.ndarray:
    return np.concatenate([a for _, s, d in runs for a in (s, d)]) if runs else np.zeros(0, dtype=np.int64)


def submission(routes: Sequence[Route], rid: np.ndarray, src: np.ndarray, dst: np.ndarray,
               block_bytes: int, submit_bytes: int = SUBMIT_BYTES) -> Iterator[list[Piece]]:
    """The copies ``src[i] -> dst[i]`` along ``routes[i]`` (global slots; ``rid[i] < 0``:
    left out) as the batches to hand over, in order: each a list of runs of one route
    that the caller queues and then flushes."""
    runs = _runs(routes, rid, src, dst)
    blocks = max(1, submit_bytes // block_bytes)
    loads = [r for r in runs if r[0].dst == GPU]
    rest = [r for r in runs if r[0].dst != GPU]
    if not loads or not rest or np.isin(_touched(loads), _touched(rest)).any():
        yield from _slices(runs, blocks)  # one kind of copy, or slots in common: the planner's order
        return
    first, then = _slices(loads, blocks), _slices(rest, blocks)
    for i in range(max(len(first), len(then))):
        if i < len(first):
            yield first[i]
        if i < len(then):
            yield then[i]
