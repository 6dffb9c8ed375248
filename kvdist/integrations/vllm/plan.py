"""What passes between the connector's two halves, as vLLM carries it (value objects:
they cross vLLM's process boundary by pickle).

Scheduler -> workers, every step (vLLM's connector metadata): kvdist's ordered copies
(``kvdist.external.Transfers``: loads into and saves out of engine block ids, and the
demotions among kvdist's tiers that room for the saves took), which of the step's loads
are asynchronous (vLLM waits for those requests in ``finished_recving``), and how many
tokens the step's forward computes (the recompute side of onboard-or-recompute).

Workers -> scheduler, every step (vLLM's connector worker metadata, joined over the
workers by ``aggregate``): each worker's recompute-policy figures, MIN over the workers
(the slowest bounds a load and a recompute alike), for ``ExternalPlanner.agree``."""

from __future__ import annotations

__all__ = ["KVDistConnectorMetadata", "KVDistWorkerMetadata"]

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from ...external import TierPlan, Transfers


@dataclass(frozen=True)
class KVDistConnectorMetadata(KVConnectorMetadata):
    transfers: Transfers = field(default_factory=lambda: Transfers(TierPlan(0, 0)))
    async_loads: frozenset[str] = frozenset()
    computed_tokens: int = 0


@dataclass(frozen=True)
class KVDistWorkerMetadata(KVConnectorWorkerMetadata):
    figures: tuple[int, ...]  # RecomputePolicy.FIGURES: host and disk load bytes/s, prefill tokens/s

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVDistWorkerMetadata:
        assert isinstance(other, KVDistWorkerMetadata), f"cannot aggregate {type(other).__name__}"
        return KVDistWorkerMetadata(tuple(map(min, self.figures, other.figures)))
