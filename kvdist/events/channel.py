"""One rank's KV cache events, wired to its manager: the recorder on the manager's pool
and the publisher. Only TP rank 0 of each replica has one (its TP peers hold the same
blocks: one stream per replica), built with the rank's cache candidate so that an
endpoint that cannot be bound fails the start-up like any other local error."""

from __future__ import annotations

from collections.abc import Callable

from ..config import EventsConfig
from ..manager import CacheManager
from .batcher import EventBuilder
from .publisher import EventPublisher, offset_endpoint
from .recorder import BlockRecorder, Record
from .wire import KVCacheEvent

__all__ = ["KVEvents"]


class KVEvents:
    """Records the manager's block changes and publishes them once per step."""

    def __init__(self, cfg: EventsConfig, replica: int, manager: CacheManager,
                 build: Callable[[list[Record]], list[KVCacheEvent]] | None = None):
        """``build``: a step's records -> its events, on the publisher's thread (default:
        an :class:`EventBuilder`'s; ``bench events`` gives one that builds nothing)."""
        replay = cfg.replay_endpoint
        if build is None:
            build = EventBuilder(manager.space, manager.tpb, manager.salt).events
        self.publisher = EventPublisher(
            offset_endpoint(cfg.endpoint, replica, "cache.events.endpoint"),
            None if replay is None else offset_endpoint(replay, replica, "cache.events.replay_endpoint"),
            cfg.topic, cfg.buffer_steps, replica, build)
        self.recorder = BlockRecorder(manager.meta, manager.tpb)
        self._manager: CacheManager | None = manager
        manager.pool.block_observer = self.recorder

    def end_step(self) -> None:
        """The step's changes, if any, become the next batch (sent by the thread)."""
        records = self.recorder.take()
        if records:
            self.publisher.submit(records)

    def close(self) -> None:
        """Publish what is left and AllBlocksCleared, then stop (idempotent)."""
        if self._manager is None:
            return
        self._manager.pool.block_observer = None
        self._manager = None
        self.recorder.cleared()
        self.publisher.submit(self.recorder.take())
        self.publisher.close()

    def stats(self) -> dict:
        p = self.publisher
        return {"endpoint": p.endpoint, "replay_endpoint": p.replay_endpoint, "submitted": p.submitted,
                "published": p.published, "dropped": p.dropped, "replays": p.replays,
                "thread_seconds": p.thread_seconds}
