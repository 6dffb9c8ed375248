"""What passes between the connector's two halves, as vLLM carries it (value objects:
they cross vLLM's process boundary by pickle).

Scheduler -> workers, every step (vLLM's connector metadata): kvdist's ordered copies
(``kvdist.external.Transfers``) in two parts, ``transfers`` (loads into engine block ids,
issued by ``start_load_kv``) and ``saves`` (copies out of the blocks this step's forward
completes, and the demotions among kvdist's tiers that room for them took, issued by
``wait_for_save`` once the forward is queued); which of the step's loads are
asynchronous (vLLM waits for those requests in ``finished_recving``); the requests that
finished with saves in flight (``held``: vLLM keeps their blocks until the workers name
them in ``finished_sending``) and those preempted with saves in flight (``preempted``:
their blocks are free again, so the forward waits for those saves); and how many tokens
the step's forward computes (the recompute side of onboard-or-recompute).

Workers -> scheduler, once at start-up (vLLM's handshake metadata, gathered from every
worker after ``register_kv_caches``): the tiers each worker committed, which the
scheduler's planner adopts (``ExternalPlanner.adopt``: a worker that could not pin its
host tier makes the planner drop it).

Workers -> scheduler, every step (vLLM's connector worker metadata, joined over the
workers by ``aggregate``): each worker's recompute-policy figures, MIN over the workers
(the slowest bounds a load and a recompute alike), for ``ExternalPlanner.agree``."""

from __future__ import annotations

__all__ = ["KVDistConnectorMetadata", "KVDistHandshake", "KVDistWorkerMetadata"]

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from ...external import TierPlan, Transfers


@dataclass(frozen=True)
class KVDistConnectorMetadata(KVConnectorMetadata):
    transfers: Transfers = field(default_factory=lambda: Transfers(TierPlan(0, 0)))
    saves: Transfers = field(default_factory=lambda: Transfers(TierPlan(0, 0)))
    async_loads: frozenset[str] = frozenset()
    held: frozenset[str] = frozenset()
    preempted: frozenset[str] = frozenset()
    computed_tokens: int = 0


@dataclass(frozen=True)
class KVDistHandshake(KVConnectorHandshakeMetadata):
    tiers: TierPlan  # what this worker's ranks committed at start-up (ExternalCache.tier_plan)
    init_status: str  # InitStatus name: KEEP_HOST or USE_NO_HOST


@dataclass(frozen=True)
class KVDistWorkerMetadata(KVConnectorWorkerMetadata):
    figures: tuple[int, ...]  # RecomputePolicy.FIGURES: host and disk load bytes/s, prefill tokens/s

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVDistWorkerMetadata:
        assert isinstance(other, KVDistWorkerMetadata), f"cannot aggregate {type(other).__name__}"
        return KVDistWorkerMetadata(tuple(map(min, self.figures, other.figures)))
