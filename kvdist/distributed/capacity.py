"""Tier capacities every rank agrees on (docs/design.md, "Start-up").

Each rank plans its own capacity in blocks per tier — from its GPU's free memory,
its node's share of host memory (``host.bytes: auto``), the configured sizes — and
the ranks then commit the element-wise MIN. TP ranks must make identical eviction
and reuse decisions for the same request stream, which they only do with identical
capacities. The MIN is taken before any tier is allocated, so it never costs a
rebuild. A rank whose planning failed contributes nothing (its error enters the
start-up protocol as ABORT)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..blocks import TIER_NAMES as TIERS

# What a rank without a plan contributes to the MIN: larger than any real capacity.
UNPLANNED = np.iinfo(np.int64).max

Capacity = tuple[int, int, int]


def encode(planned: Capacity | None) -> list[int]:
    """The row a rank contributes to the capacity reduction."""
    if planned is None:
        return [int(UNPLANNED)] * len(TIERS)
    assert len(planned) == len(TIERS) and all(n >= 0 for n in planned), f"bad plan {planned}"
    return [int(n) for n in planned]


def min_capacity(rows: np.ndarray) -> Capacity | None:
    """Element-wise MIN of the rows of the ranks that planned (``[ranks, 3]``, rows of
    ranks without a plan are UNPLANNED); None when no rank planned."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, len(TIERS))
    agreed = rows.min(axis=0)
    if agreed[0] == UNPLANNED:
        return None
    return tuple(int(n) for n in agreed)  # type: ignore[return-value]


def describe(per_rank: Sequence[Capacity | None], agreed: Capacity) -> str:
    """Which ranks planned more than the agreed capacity, for logs."""
    out = []
    for r, plan in enumerate(per_rank):
        if plan is not None and tuple(plan) != tuple(agreed):
            diff = ", ".join(f"{t} {p}->{a}" for t, p, a in zip(TIERS, plan, agreed) if p != a)
            out.append(f"rank {r}: {diff}")
    return "; ".join(out)
