"""KV cache events (docs/design.md, "KV cache events"): the blocks each tier of a replica
stores and removes, published by TP rank 0 of every replica in vLLM's wire format over
ZMQ (``cache.events``), and the subscriber side a router uses. Needs the ``events``
extra (pyzmq, msgspec).

Cache side: ``recorder`` (the pool's block observer: the records, written in place into
the ``shared_log``), ``channel`` (the wiring), ``endpoints`` (where a replica
publishes), ``process`` (the publisher, a process of its own that reads the log; its
main is ``child``) or ``publisher`` (the same on a thread, for ``bench events``). In the publisher:
``batcher`` (records -> events), ``server`` (PUB + replay sockets).
Subscriber side: ``subscriber`` (a gap-free stream), ``block_index`` (per-replica block
sets, longest cached prefix). Both speak ``wire``."""

from .block_index import ClusterBlocks, ReplicaBlocks, prompt_hashes
from .endpoints import connectable, replica_endpoints
from .subscriber import EventSubscriber
from .wire import (
    MEDIA,
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decoder,
    wire_hash,
)

__all__ = ["MEDIA", "MEDIUM_CPU", "MEDIUM_DISK", "MEDIUM_GPU", "AllBlocksCleared", "BlockRemoved",
           "BlockStored", "ClusterBlocks", "EventSubscriber", "KVEventBatch", "ReplicaBlocks", "connectable",
           "decoder", "prompt_hashes", "replica_endpoints", "wire_hash"]
