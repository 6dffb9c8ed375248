"""vLLM's KV event wire format, as vLLM v0.33.0 defines it in
``vllm/distributed/kv_events.py``, so that a subscriber written for vLLM decodes
kvdist's batches unchanged.

* ``KVEventBatch`` is ``array_like``: msgpack ``[ts, events]``, plus
  ``data_parallel_rank`` as a third element when it is set (``omit_defaults``).
* Each event is a tagged struct (``tag=True``), *not* array-like: a msgpack map whose
  ``"type"`` key names the class (``"BlockStored"``, ``"BlockRemoved"``,
  ``"AllBlocksCleared"``), its fields under their names, fields equal to their
  default left out (``omit_defaults``). Field order is vLLM's, below.
* Block hashes are 64-bit unsigned ints (vLLM's default, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``):
  kvdist publishes the low 64 bits of its 128-bit prefix hash (``kvdist.prefix``).

kvdist fills ``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``,
``lora_id`` (None), ``medium`` and ``lora_name`` (None); the optional fields stay at
their defaults and are not sent."""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["MEDIUM_CPU", "MEDIUM_DISK", "MEDIUM_GPU", "MEDIA", "AllBlocksCleared", "BlockRemoved",
           "BlockStored", "EventBatch", "KVCacheEvent", "KVEventBatch", "decoder", "encoder", "wire_hash"]

# The medium of each kvdist tier (indexed by kvdist.blocks.GPU, HOST, DISK). vLLM names
# GPU and CPU; kvdist's disk tier is "DISK" (docs/design.md, "KV cache events").
MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK = "GPU", "CPU", "DISK"
MEDIA = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK)

_MASK64 = (1 << 64) - 1


def wire_hash(h: int) -> int:
    """The block hash a subscriber sees for kvdist's 128-bit prefix hash ``h``."""
    return h & _MASK64


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base of the events: encoded as a map tagged ``"type": <class name>``."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None  # of block_hashes[0]; each later hash's parent is the one before
    token_ids: list[int]  # block_size per hash, in order
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder() -> msgspec.msgpack.Decoder:
    """Decodes one payload into a :class:`KVEventBatch` (raises ``msgspec.DecodeError``
    / ``msgspec.ValidationError`` for anything else)."""
    return msgspec.msgpack.Decoder(type=KVEventBatch)
