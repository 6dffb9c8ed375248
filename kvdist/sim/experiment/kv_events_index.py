"""The prefix-aware router's view of the replicas' caches: a subscriber to every
replica's KV events (:mod:`kvdist.events`, vLLM's wire format over ZMQ) and the
per-replica block sets they build, asked for the longest cached prefix of a prompt
(:class:`~kvdist.sim.experiment.kv_router.CachedPrefixes`). Every medium a replica
publishes counts (GPU, CPU for the host tier, DISK); the remote tier publishes
nothing — a block another replica holds is that replica's. The endpoints are those
:func:`~kvdist.sim.experiment.route_net.exchange` gathered: a replica on another node is
subscribed to across the network. Needs the ``events`` extra."""

from __future__ import annotations

from collections.abc import Sequence

import zmq

from ...config import CacheConfig
from ...events import ClusterBlocks, EventSubscriber, prompt_hashes
from ...layout import KVLayout
from ..engine.request import Request
from .kv_router import KvAware

__all__ = ["EventIndex", "kv_aware"]


class EventIndex:
    """One subscriber per replica (``endpoints[k]``: replica k's ``(endpoint, replay
    endpoint)``), their batches applied in sequence order to a :class:`ClusterBlocks`,
    from the first one each publisher still keeps (replayed at the start: a PUB socket
    drops what it sends before a subscriber's connection is up). Batches a subscriber
    lost (the publisher's buffer no longer had them) leave its replica's set
    approximate: a route is then worse, never wrong (``lost`` counts them)."""

    def __init__(self, endpoints: Sequence[tuple[str, str | None]], topic: str = ""):
        self._ctx = zmq.Context()
        self.subs = [EventSubscriber(ep, replay, topic, context=self._ctx) for ep, replay in endpoints]
        self.blocks = ClusterBlocks(len(self.subs))
        self.batches = 0  # applied, over every replica
        for k, sub in enumerate(self.subs):
            if sub.replay_sock is not None:
                self._apply(k, sub.catch_up())

    def _apply(self, replica: int, batches) -> None:
        for _, batch in batches:
            self.blocks.apply(batch, replica)
            self.batches += 1

    def sockets(self) -> list:
        return [s.sub for s in self.subs]

    def poll(self) -> None:
        for k, sub in enumerate(self.subs):
            self._apply(k, sub.poll(0))

    @property
    def lost(self) -> int:
        return sum(s.lost for s in self.subs)

    def longest_prefix(self, replica: int, hashes: Sequence) -> int:
        return self.blocks.replicas[replica].prefix_blocks(hashes)

    def close(self) -> None:
        for s in self.subs:
            s.close()
        self._ctx.term()


def kv_aware(cfg: CacheConfig, replicas: int, endpoints: Sequence[tuple[str, str | None]]
             ) -> tuple[KvAware, EventIndex]:
    """The prefix-aware policy over the replicas' events (rank 0, once their
    publishers are bound)."""
    assert len(endpoints) == replicas, f"{len(endpoints)} event streams for {replicas} replicas"
    index = EventIndex(endpoints, cfg.cache.events.topic)
    layout = KVLayout.from_config(cfg)

    def hashes(req: Request) -> list[int]:
        return prompt_hashes(req.prompt.tolist(), layout)

    policy = KvAware(replicas, index, hashes, cfg.cache.tokens_per_block,
                     overlap_weight=cfg.workload.router_overlap_weight)
    return policy, index
