"""The routes a block takes between tiers: one value per (source tier, destination
tier), carrying its name and the copy stream it runs on. The manager picks a route
when it moves a block, the engine batches copies by route, and each executor has one
handler per route; nobody re-derives the route from slot numbers or strings."""

from __future__ import annotations

from dataclasses import dataclass

from ..blocks import DISK, GPU, HOST, TIER_NAMES

__all__ = ["DEMOTE", "RELOAD", "OFFLOAD", "ONBOARD", "PROMOTE", "ROUTES", "ROUTE_NAMES", "SPILL",
           "STREAMS", "Route", "route"]


@dataclass(frozen=True, slots=True, eq=False)
class Route:
    """Copies from tier ``src`` to tier ``dst`` (``kvdist.blocks`` tier numbers), named
    ``name``, on the copy stream ``stream``. One instance per route: compared and hashed
    by identity."""

    name: str
    src: int
    dst: int
    stream: str

    def __repr__(self) -> str:
        return f"Route({self.name}: {TIER_NAMES[self.src]} -> {TIER_NAMES[self.dst]})"


OFFLOAD = Route("offload", GPU, HOST, "offload")  # an evicted GPU block to the host tier
ONBOARD = Route("onboard", HOST, GPU, "onboard")  # a host hit back into the GPU tier
DEMOTE = Route("demote", HOST, DISK, "disk")  # an evicted host block to the disk tier
SPILL = Route("spill", GPU, DISK, "disk")  # an evicted GPU block to disk (no host tier)
RELOAD = Route("reload", DISK, GPU, "disk")  # a disk hit back into the GPU tier (a spill's way back)
# A prefetch's reads run beside the step's own disk work, on a stream of their own: nothing
# of a step waits for them (its admission waits for them to land, kvdist.loads).
PROMOTE = Route("promote", DISK, HOST, "promote")  # a prefetched disk block into the host tier

ROUTES = (OFFLOAD, ONBOARD, DEMOTE, SPILL, RELOAD, PROMOTE)
ROUTE_NAMES = tuple(r.name for r in ROUTES)
STREAMS = ("offload", "onboard", "disk", "promote")

# ROUTES indexed [source tier][destination tier]; None where no block ever goes.
_BETWEEN: tuple[tuple[Route | None, ...], ...] = tuple(
    tuple(next((r for r in ROUTES if (r.src, r.dst) == (a, b)), None) for b in (GPU, HOST, DISK))
    for a in (GPU, HOST, DISK))


def route(src_tier: int, dst_tier: int) -> Route:
    """The route from ``src_tier`` to ``dst_tier``."""
    r = _BETWEEN[src_tier][dst_tier]
    assert r is not None, f"no route from {TIER_NAMES[src_tier]} to {TIER_NAMES[dst_tier]}"
    return r
