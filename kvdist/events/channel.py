"""One rank's KV cache events, wired to its manager: the recorder on the manager's pool
and the publisher. Only TP rank 0 of each replica has one (its TP peers hold the same
blocks: one stream per replica), built with the rank's cache candidate so that an
endpoint that cannot be bound fails the start-up like any other local error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol

from ..config import EventsConfig
from ..manager import CacheManager
from .endpoints import replica_endpoints
from .recorder import BlockRecorder

__all__ = ["KVEvents", "Publisher"]


class Publisher(Protocol):
    """What the channel needs of a publisher (``kvdist.events.process``, ``.publisher``):
    the recorder the pool writes into, which it reads."""

    endpoint: str
    replay_endpoint: str | None
    recorder: BlockRecorder

    def end_step(self) -> None:
        """The step's changes, if any, become the next batch."""

    def stats(self) -> dict: ...

    def close(self) -> None: ...


def _nothing() -> None:
    """A closed channel's step end."""


class KVEvents:
    """Records the manager's block changes and hands each step's to the publisher."""

    def __init__(self, cfg: EventsConfig, replica: int, manager: CacheManager,
                 publisher: Literal["process", "thread"] = "process",
                 build: Literal["events", "empty", "none"] = "events"):
        """``publisher``: a process of its own (the cache's) or a thread of this one
        (``bench events`` compares them). ``build``: ``"empty"``, a publisher that
        builds no event (empty batches), ``"none"`` (a process only), one that reads the
        steps and drops them: ``bench events``' idle runs."""
        endpoint, replay = replica_endpoints(cfg, replica)
        self.publisher: Publisher
        if publisher == "process":
            from .process import ProcessPublisher
            self.publisher = ProcessPublisher(endpoint, replay, cfg.topic, cfg.buffer_steps, replica,
                                              manager.space.capacity, manager.tpb, manager.salt, build=build)
        else:
            from .batcher import EventBuilder
            from .publisher import ThreadPublisher
            self.publisher = ThreadPublisher(
                endpoint, replay, cfg.topic, cfg.buffer_steps, replica,
                EventBuilder(manager.space, manager.tpb, manager.salt).events if build == "events"
                else lambda step: [])
        self.recorder = self.publisher.recorder
        self._manager: CacheManager | None = manager
        manager.pool.block_observer = self.recorder
        # The step's changes, if any, become the next batch: the publisher's own call
        # (the cache's: the recorder's hand-over, with no call of ours around it).
        self.end_step: Callable[[], object] = self.publisher.end_step

    def close(self) -> None:
        """Publish what is left and AllBlocksCleared, then stop (idempotent)."""
        if self._manager is None:
            return
        self._manager.pool.block_observer = None
        self._manager = None
        self.recorder.cleared()
        self.end_step()
        self.publisher.close()
        self.end_step = _nothing

    def stats(self) -> dict:
        return self.publisher.stats()
