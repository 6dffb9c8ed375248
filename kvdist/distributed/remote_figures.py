"""The remote tier's figures: one rank's counters, and the ``stats()["remote"]`` dict an
operator reads (docs/design.md, "Remote tier"; ``RemoteTier.stats``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .directory import Directory
from .directory_channel import DirectoryChannel
from .transport import REASONS, Batch, Fetcher

__all__ = ["RemoteCounters", "remote_figures"]


@dataclass(slots=True)
class RemoteCounters:
    """Per rank. ``landed``/``misses`` are the replica's verdicts (equal on its ranks);
    the reasons are this rank's own view of why it gave blocks up."""

    batches: int = 0
    blocks_requested: int = 0
    landed: int = 0
    landed_duplicate: int = 0  # landed but the block was cached here meanwhile
    misses: int = 0
    reasons: dict[str, int] = field(default_factory=lambda: {r: 0 for r in REASONS[1:]})
    hit_blocks: list[int] = field(default_factory=lambda: [0, 0, 0])  # by the tier they were found in
    prefetches: int = 0
    pull_seconds: float = 0.0  # add_sequence waiting for its own fetches
    agree_seconds: float = 0.0  # the TP group's agreements
    upkeep_seconds: float = 0.0  # directory, stamps, service, polling


def remote_figures(c: RemoteCounters, transports: Iterable[Fetcher], inflight: list[Batch],
                   directory: Directory, channel: DirectoryChannel) -> dict:
    """The remote part of ``stats()``: the counters, what is in flight (``inflight``),
    the directory's size and traffic (``transports``: per peer replica)."""
    kinds: dict[str, int] = {}
    for t in transports:
        kinds[t.name] = kinds.get(t.name, 0) + 1
    return {
        "transports": kinds,  # peers reached by each transport
        "batches": c.batches,
        "blocks_requested": c.blocks_requested,
        "blocks_landed": c.landed,
        "blocks_landed_duplicate": c.landed_duplicate,
        "misses": c.misses,
        "given_up_here": dict(c.reasons),
        "in_flight_blocks": sum(int((~b.decided).sum()) for b in inflight),
        "prefetches": c.prefetches,
        "directory_blocks": directory.known(),
        "directory_bytes": directory.nbytes,
        "node_directory_bytes": node.shape.nbytes if (node := channel.node) else 0,
        "directory_records_applied": directory.records_applied,
        "directory_messages_sent": channel.messages_sent,
        "directory_bytes_sent": channel.bytes_sent,
        "directory_messages_received": channel.messages_received,
        "pull_seconds": c.pull_seconds,
        "agree_seconds": c.agree_seconds,
        "upkeep_seconds": c.upkeep_seconds,
    }
