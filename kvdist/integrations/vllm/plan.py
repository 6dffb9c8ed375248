"""The plan the scheduler-side connector ships to every worker each step (vLLM's
connector metadata): kvdist's ordered copies (``kvdist.external.Transfers``: loads into
and saves out of engine block ids, and the demotions among kvdist's tiers that room for
the saves took) and which of the step's loads are asynchronous (vLLM waits for those
requests to show up in ``finished_recving``). A value object: it crosses vLLM's process
boundary by pickle."""

from __future__ import annotations

__all__ = ["KVDistConnectorMetadata"]

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ...external import TierPlan, Transfers


@dataclass(frozen=True)
class KVDistConnectorMetadata(KVConnectorMetadata):
    transfers: Transfers = field(default_factory=lambda: Transfers(TierPlan(0, 0)))
    async_loads: frozenset[str] = frozenset()
