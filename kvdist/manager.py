"""The single-rank cache: sequences, prefix reuse, the eviction cascade, steps.

Invariants (``check_invariants`` verifies them):

* every slot is in exactly one place: its tier's free stack (FREE), its tier's
  eviction lists (CACHED, unreferenced), held by sequences (GPU only, refcount > 0),
  or in transit inside one call;
* a slot is in the prefix index iff it is CACHED; each hash is indexed at most once,
  so a block lives in one tier at a time (moves are exclusive: an onboarded host block
  leaves the host tier);
* host and disk slots are never referenced by sequences;
* a block filled in step N enters the index at ``end_step`` of step N, never earlier.

All per-block state is in :class:`~kvdist.blocks.BlockMeta`; the per-step work is
proportional to the blocks a step touches."""

from __future__ import annotations

import time
from array import array
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from . import manager_checks
from .blocks import (
    CACHED,
    DISK,
    FREE,
    GPU,
    HOST,
    NO_SLOT,
    TIER_NAMES,
    BlockMeta,
    FreeQueue,
    FreeStack,
    SlotSpace,
)
from .cascade import EvictionCascade, HostObserver
from .errors import OutOfBlocksError
from .eviction import DEFAULT_PRIORITY, NUM_PRIORITIES, PriorityLRU
from .layout import KVLayout
from .prefix import MASK64, PrefixIndex, chain_hashes, digest_bytes
from .recompute_policy import RecomputePolicy
from .sequences import Sequence, token_array
from .staging import TableRows
from .staging.rows import DEFAULT_ROWS
from .transfer import (
    DEMOTE,
    PROMOTE,
    RELOAD,
    ROUTE_NAMES,
    SPILL,
    EngineSeams,
    Executor,
    Route,
    TransferEngine,
    route,
)
from .transfer.bounce import bounce_blocks

__all__ = ["DEMOTE_BATCH_BYTES", "CacheCounters", "CacheManager", "HostObserver", "Sequence", "token_array"]

# Bytes of one batch of disk writes (demotions): a later copy into one of its source host
# slots waits for its whole batch, so the engine cuts demotions into batches of about this
# size, written in order, and each slot is free again once its own batch is on disk.
DEMOTE_BATCH_BYTES = 32 << 20


@dataclass(slots=True)
class CacheCounters:
    hit_tokens: list[int] = field(default_factory=lambda: [0, 0, 0])
    prompt_tokens: int = 0
    blocks_moved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROUTE_NAMES, 0))
    evictions: list[int] = field(default_factory=lambda: [0, 0, 0])
    dropped: int = 0
    steps: int = 0


class CacheManager(EvictionCascade):
    """Block bookkeeping of one rank over up to three tiers; copies go through a
    :class:`~kvdist.transfer.TransferEngine` bound to ``executor``."""

    def __init__(self, layout: KVLayout, capacity: tuple[int, int, int], executor: Executor, *,
                 enable_reuse: bool = True, offload_min_priority: int = 0, demote_ahead: int = 0,
                 engine_seams: EngineSeams | None = None, table_rows: int = DEFAULT_ROWS,
                 recompute_when_faster: bool = True):
        assert capacity[GPU] > 0, "the GPU tier needs at least one block"
        self.layout = layout
        self.tpb = layout.tokens_per_block
        self.layered = executor.layered  # S5 per layer (kv_pool) rather than at block_table
        self.space = SlotSpace(capacity)
        self.meta = BlockMeta(self.space.total)
        # The host tier reuses its oldest free slot first when disk writes may still be
        # reading the newest (FreeQueue); elsewhere the last freed slot goes first.
        kinds = (FreeStack, FreeQueue if capacity[DISK] else FreeStack, FreeStack)
        self.free = [kinds[t](self.space.base[t], capacity[t]) if capacity[t] else None
                     for t in (GPU, HOST, DISK)]
        self.lru = [PriorityLRU(self.meta) for _ in (GPU, HOST, DISK)]
        self.index = PrefixIndex(self.space.total, self.meta)
        bpb = layout.bytes_per_block
        limits = {DEMOTE: max(1, DEMOTE_BATCH_BYTES // bpb),  # see DEMOTE_BATCH_BYTES
                  RELOAD: bounce_blocks(bpb), SPILL: bounce_blocks(bpb)}  # one bounce buffer each
        self.engine = TransferEngine(self.space, executor, seams=engine_seams or EngineSeams(),
                                     block_id=self._block_id, batch_limits=limits)
        self.enable_reuse = enable_reuse
        self.offload_min_priority = offload_min_priority
        self.demote_ahead = demote_ahead if capacity[HOST] and capacity[DISK] else 0
        self.salt = layout.hash_salt()
        self.policy = RecomputePolicy(layout.bytes_per_block, self.tpb, recompute_when_faster)
        self.seqs: dict[Hashable, Sequence] = {}
        self.host_table = TableRows(rows=table_rows)  # persistent rows; step tables are gathered from it
        self._dirty: dict[Hashable, Sequence] = {}  # sequences that got tokens this step
        self._deferred_release: list[Sequence] = []
        self.counters = CacheCounters()
        self.transfer_seconds = 0.0
        self.bookkeeping_seconds = 0.0
        # Tier order for eviction: where a block evicted from tier t may go.
        self._colder = {GPU: [route(GPU, t) for t in (HOST, DISK) if capacity[t]],
                        HOST: [route(HOST, DISK)] if capacity[DISK] else [], DISK: []}
        # The copies of one cascade, handed to the engine together at its end (in order,
        # one call per run of one route).
        self._moves: tuple[list[int], list[int], list[Route]] = ([], [], [])  # src, dst, route
        # Told when a host slot gets or loses its block (the remote tier's stamps and
        # directory); None when nobody listens.
        self.host_observer: HostObserver | None = None

    # -- helpers ----------------------------------------------------------------------------
    def _block_id(self, slot: int) -> tuple[int, int]:
        return self.meta.hi_mv[slot], self.meta.lo_mv[slot]

    def has_tier(self, tier: int) -> bool:
        return self.space.capacity[tier] > 0

    def _available_gpu(self) -> int:
        return len(self.free[GPU]) + len(self.lru[GPU])

    def block_hashes(self, tok: array) -> list[int]:
        """The chained hashes of the full blocks of the int32 token ids ``tok``."""
        return chain_hashes(self.salt, memoryview(tok).cast("B"), 0, len(tok) // self.tpb, self.tpb)

    def _tiers_of(self, slots: list[int]) -> list[int]:
        """The tier of each slot."""
        gpu_end, tier_of = self.space.base[HOST], self.space.tier_of
        return [GPU if s < gpu_end else tier_of(s) for s in slots]

    def gpu_budget(self, hits: list[int], n_blocks: int) -> tuple[int, int, int]:
        """For a prompt of ``n_blocks`` whose cached prefix is in slots ``hits``: (hits
        on the GPU, fresh GPU blocks it needs, GPU blocks that can be had for it)."""
        gpu_end, ref = self.space.base[HOST], self.meta.ref_mv
        on_gpu = pinned_gpu = 0
        for s in hits:
            if s < gpu_end:
                on_gpu += 1
                pinned_gpu += ref[s] == 0
        return on_gpu, n_blocks - on_gpu, self._available_gpu() - pinned_gpu

    # -- the step API ----------------------------------------------------------------------------
    def begin_step(self) -> None:
        t0 = time.perf_counter()
        self.engine.begin_step()
        self.transfer_seconds += time.perf_counter() - t0

    def add_sequence(self, seq_id: Hashable, tokens: Iterable[int],
                     priority: int = DEFAULT_PRIORITY, hashes: list[int] | None = None,
                     hits: list[int] | None = None) -> int:
        """Admit a prompt: reuse its longest cached prefix of whole blocks from any tier
        (leaving at least one token to compute), allocate GPU blocks for the rest.
        Returns the number of prompt tokens reused. ``hashes``: the hashes of its full
        blocks (``block_hashes``), when the caller computed them already; ``hits``: the
        slots of their reusable prefix, when the caller matched them already (and the
        cache did not change since)."""
        t0 = time.perf_counter()
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} is already in the cache")
        if isinstance(priority, bool) or not isinstance(priority, int) or \
                not 0 <= priority < NUM_PRIORITIES:
            raise ValueError(f"priority must be an int in 0..{NUM_PRIORITIES - 1}, got {priority!r}")
        tok = token_array(tokens)
        n = len(tok)
        if n == 0:
            raise ValueError(f"sequence {seq_id!r} has no tokens")
        tpb, meta, space = self.tpb, self.meta, self.space
        n_blocks = -(-n // tpb)
        matched, hits = hits, []
        if self.enable_reuse:
            # Every full block's hash at once: the leading ones find the reusable prefix,
            # the rest go into their fresh slots' meta now and into the index at end_step.
            if hashes is None:
                hashes = self.block_hashes(tok)
            assert len(hashes) == n // tpb, f"{len(hashes)} hashes for {n // tpb} full blocks"
            hits = self.index.match(hashes[: (n - 1) // tpb]) if matched is None else matched
        else:
            hashes = []
        gpu_end = space.base[HOST]
        on_gpu = sum(s < gpu_end for s in hits)
        cold: list[int] | None = None  # the hits' tiers, when some are not on the GPU
        if on_gpu < len(hits):
            cold = self._tiers_of(hits)
            hits = hits[: self.policy.cut(cold)]  # onboard or recompute
        on_gpu, need, available = self.gpu_budget(hits, n_blocks)
        if need > available:
            raise OutOfBlocksError(need, available, f"sequence {seq_id!r} ({n} tokens)")
        if cold is not None:
            self.policy.record(cold, len(hits))
        ref, prio = meta.ref_mv, meta.prio_mv
        lru_gpu = self.lru[GPU]
        # Pin every hit first, so the cascade below cannot evict them.
        for s in hits:
            if s < gpu_end:
                if ref[s] == 0:
                    lru_gpu.remove(s)
                ref[s] += 1
                if prio[s] < priority:
                    prio[s] = priority
            else:
                self.lru[space.tier_of(s)].remove(s)
        fresh = self._alloc_gpu(need, priority)
        hit_tokens = self.counters.hit_tokens
        hit_tokens[GPU] += on_gpu * tpb
        if on_gpu == len(hits):
            slots = hits + fresh
        else:  # onboard the host and disk hits into fresh GPU slots, in prompt order
            slots, k = [], 0
            for s in hits:
                if s >= gpu_end:
                    tier = space.tier_of(s)
                    hit_tokens[tier] += tpb
                    g = fresh[k]
                    k += 1
                    self._move(s, g, route(tier, GPU))
                    ref[g] = 1
                    if prio[g] < priority:
                        prio[g] = priority
                    s = g
                slots.append(s)
            self._submit_moves()
            slots.extend(fresh[k:])
        hi, lo = meta.hi_mv, meta.lo_mv
        for i in range(len(hits), len(hashes)):
            h, s = hashes[i], slots[i]
            hi[s] = h >> 64
            lo[s] = h & MASK64
        parent = digest_bytes(hashes[-1]) if hashes else self.salt
        seq = Sequence(seq_id, tok, slots, priority, len(hashes), parent, len(hits))
        self.seqs[seq_id] = seq
        self._dirty[seq_id] = seq
        self.counters.prompt_tokens += n
        self.bookkeeping_seconds += time.perf_counter() - t0
        return len(hits) * tpb

    def prefetch(self, tokens: Iterable[int]) -> int:
        """Move the disk blocks of a prompt's reusable cached prefix (as ``add_sequence``
        would reuse it now: the recompute policy's cut) into the host tier, so that its
        ``add_sequence`` onboards them from host memory, the read from disk done by
        then or under way. The prefix's host blocks and the promoted ones become the
        host tier's most recently used; a promotion may evict colder host blocks (to
        disk, as ever). Returns the number of blocks promoted (0 without a host and a
        disk tier, or when no host slot can be had)."""
        if not (self.enable_reuse and self.has_tier(HOST) and self.has_tier(DISK)):
            return 0
        t0 = time.perf_counter()
        tok = token_array(tokens)
        n = len(tok)
        hits = self.index.match(self.block_hashes(tok)[: (n - 1) // self.tpb]) if n else []
        tiers = self._tiers_of(hits)
        if DISK not in tiers:
            return 0
        k = self.policy.cut(tiers)
        cold = [(s, t) for s, t in zip(hits[:k], tiers[:k]) if t != GPU]
        for s, t in cold:  # out of reach of the cascade below
            self.lru[t].remove(s)
        promoted, placed = 0, []
        for s, t in cold:
            if t == DISK:
                h = self._take_slot(HOST)
                if h == NO_SLOT:  # every host block is in this prefix: leave the rest on disk
                    placed.append((s, t))
                    continue
                self._move(s, h, PROMOTE)
                promoted += 1
                s = h
                t = HOST
            placed.append((s, t))
        for s, t in reversed(placed):  # last block first: the prefix's tail leaves first
            self.lru[t].push(s)
        self._submit_moves()
        self.bookkeeping_seconds += time.perf_counter() - t0
        return promoted

    def append_tokens(self, seq_id: Hashable, tokens: Iterable[int]) -> None:
        """Grow a sequence by decoded tokens (their K/V is written in this step)."""
        t0 = time.perf_counter()
        seq = self._get(seq_id)
        tok = token_array(tokens)  # the whole input first: a bad id changes nothing
        need = -(-(len(seq.tokens) + len(tok)) // self.tpb) - len(seq.slots)
        if need > 0:
            available = self._available_gpu()
            if need > available:
                raise OutOfBlocksError(need, available, f"appending to sequence {seq_id!r}")
            seq.slots.extend(self._alloc_gpu(need, seq.priority))
        seq.tokens.extend(tok)
        self._dirty[seq_id] = seq
        self.bookkeeping_seconds += time.perf_counter() - t0

    def table_rows(self, seq_ids: list[Hashable], alloc=None) -> np.ndarray:
        """Host-side block table: int32 ``[len(seq_ids), max blocks]`` padded with -1,
        gathered from the persistent rows (only blocks new since the last table are
        written there). ``alloc(shape, dtype)`` supplies the output, e.g. a staging buffer."""
        rows, width = self.host_table.rows_for(seq_ids, self.seqs)
        shape = (len(rows), width)
        out = np.empty(shape, dtype=np.int32) if alloc is None else alloc(shape, np.int32)
        return self.host_table.gather(rows, width, out)

    def before_compute(self) -> None:
        """S5: every queued copy is submitted and compute waits for it (layer by layer,
        in ``before_layer``, when copies go by layer group)."""
        t0 = time.perf_counter()
        self.engine.before_compute(layered=self.layered)
        self.transfer_seconds += time.perf_counter() - t0

    def before_layer(self, layer: int) -> None:
        """S5 for one layer: compute waits for the copies of that layer's group."""
        if self.layered:
            self.engine.before_layer(layer)

    def end_step(self) -> None:
        """Blocks filled in this step enter the prefix index; deferred releases run."""
        t0 = time.perf_counter()
        if self.enable_reuse:
            tpb = self.tpb
            for seq in chain(self._dirty.values(), self._deferred_release):
                if len(seq.tokens) // tpb > seq.num_indexed:
                    self._register_full_blocks(seq)
        self._dirty.clear()
        for seq in self._deferred_release:
            self._free_blocks(seq)
        self._deferred_release.clear()
        for copied, nbytes, seconds in self.engine.executor.take_timings():  # onboards, reloads
            self.policy.observe_copy(copied.src, nbytes, seconds)
        if len(self.free[HOST] or ()) < self.demote_ahead and self.policy.worth_storing(DISK):
            # Writes start now and run during the next forward pass, so the next
            # step's offloads land in host slots no disk write is still reading.
            self._make_free(HOST, self.demote_ahead)
            self.engine.flush()
        self.counters.steps += 1
        self.bookkeeping_seconds += time.perf_counter() - t0

    def _register_full_blocks(self, seq: Sequence) -> None:
        full = len(seq.tokens) // self.tpb
        meta, slots = self.meta, seq.slots
        if full > seq.num_hashed:  # blocks filled by decode: hash them now
            hashes = chain_hashes(seq.parent, memoryview(seq.tokens).cast("B"), seq.num_hashed,
                                  full - seq.num_hashed, self.tpb)
            hi, lo = meta.hi_mv, meta.lo_mv
            for h, s in zip(hashes, slots[seq.num_hashed : full]):
                hi[s] = h >> 64
                lo[s] = h & MASK64
            seq.num_hashed = full
            seq.parent = digest_bytes(hashes[-1])
        insert, state = self.index.insert, meta.state_mv
        for s in slots[seq.num_indexed : full]:
            if insert(s):
                state[s] = CACHED
            # else: another slot already holds this block; this copy stays private.
        seq.num_indexed = full

    def release(self, seq_id: Hashable) -> None:
        """The sequence is done. Its full blocks stay cached (evictable); the rest are
        freed. If it got tokens in the current step, this happens at ``end_step``."""
        seq = self._get(seq_id)
        del self.seqs[seq_id]
        if self._dirty.pop(seq_id, None) is not None:
            # Filled in this step: registered, then freed, at end_step. Out of _dirty, so
            # the same id can be added again in this step.
            self._deferred_release.append(seq)
        else:
            self._free_blocks(seq)

    def _free_blocks(self, seq: Sequence) -> None:
        meta = self.meta
        ref, state, free_push = meta.ref_mv, meta.state_mv, self.free[GPU].push
        unreferenced: list[int] = []
        # Last block first: the tail of a prefix becomes the older entry, so it is
        # evicted before the blocks it depends on.
        for s in reversed(seq.slots):
            r = ref[s] - 1
            ref[s] = r
            if r == 0:
                if state[s] == CACHED:
                    unreferenced.append(s)
                else:
                    state[s] = FREE
                    free_push(s)
        self.lru[GPU].push_run(unreferenced)

    def _get(self, seq_id: Hashable) -> Sequence:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}") from None

    def synchronize(self) -> None:
        t0 = time.perf_counter()
        self.engine.synchronize()
        self.transfer_seconds += time.perf_counter() - t0

    # -- observability ---------------------------------------------------------------------------
    def tier_names(self) -> tuple[str, ...]:
        return tuple(TIER_NAMES[t] for t in (GPU, HOST, DISK) if self.has_tier(t))

    def usage(self) -> dict[str, tuple[int, int]]:
        """{tier: (used, free)} blocks."""
        return {TIER_NAMES[t]: (self.space.capacity[t] - len(self.free[t]), len(self.free[t]))
                for t in (GPU, HOST, DISK) if self.has_tier(t)}

    def metadata_bytes(self) -> int:
        """Bytes of the per-slot arrays: block metadata, prefix index, free stacks and
        the transfer engine's per-slot tracking."""
        stacks = sum(f.nbytes for f in self.free if f is not None)
        return self.meta.nbytes + self.index.nbytes + stacks + self.engine.nbytes

    def state_digest(self) -> bytes:
        """xxh3-128 of the state that decides this cache's future behaviour (see
        :func:`~kvdist.manager_checks.state_digest`)."""
        return manager_checks.state_digest(self)

    def check_invariants(self) -> None:
        """Verify the invariants of the module docstring and the transfer engine's (O(total slots))."""
        manager_checks.check_invariants(self)
        self.engine.check_invariants()
