"""KV cache events (docs/design.md, "KV cache events"): the blocks each tier of a replica
stores and removes, published by TP rank 0 of every replica in vLLM's wire format over
ZMQ (``cache.events``), and the subscriber side a router uses. Needs the ``events``
extra (pyzmq, msgspec).

Cache side: ``recorder`` (the pool's block observer), ``batcher`` (records -> events),
``publisher`` (PUB + replay sockets, a background thread), ``channel`` (the wiring).
Subscriber side: ``subscriber`` (a gap-free stream), ``block_index`` (per-replica block
sets, longest cached prefix). Both speak ``wire``."""

from .block_index import ClusterBlocks, ReplicaBlocks, prompt_hashes
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
           "BlockStored", "ClusterBlocks", "EventSubscriber", "KVEventBatch", "ReplicaBlocks", "decoder",
           "prompt_hashes", "wire_hash"]
