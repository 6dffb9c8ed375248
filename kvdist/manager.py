"""The single-rank cache: sequences, admission, prefix reuse, steps. Every change to a
slot (free lists, eviction lists, reference counts, the eviction cascade and its moves)
goes through the :class:`~kvdist.block_pool.BlockPool`; admission is a plan
(``plan``: an :class:`~kvdist.admission_plan.AdmissionPlan`, nothing changed), then
``commit`` (nano-vllm's ``can_allocate`` -> ``allocate``).

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
from itertools import chain

import numpy as np

from . import manager_checks
from .admission_plan import AdmissionPlan
from .block_log import log_registered
from .block_pool import BlockPool, HostObserver
from .blocks import DISK, GPU, HOST, TIER_NAMES, BlockMeta, SlotSpace
from .counters import CacheCounters
from .errors import OutOfBlocksError
from .eviction import DEFAULT_PRIORITY, NUM_PRIORITIES, PriorityLRU
from .layout import KVLayout
from .prefix import PrefixIndex, chain_digests, chain_hashes
from .recompute_policy import RecomputePolicy
from .sequences import Sequence, token_array
from .staging import TableRows
from .staging.rows import DEFAULT_ROWS
from .transfer import DEMOTE, RELOAD, SPILL, EngineSeams, Executor, TransferEngine, route
from .transfer.bounce import bounce_blocks

__all__ = ["DEMOTE_BATCH_BYTES", "AdmissionPlan", "CacheCounters", "CacheManager", "HostObserver",
           "Sequence", "token_array"]

# Bytes of one batch of disk writes (demotions): a later copy into one of its source host
# slots waits for its whole batch, so the engine cuts demotions into batches of about this
# size, written in order, and each slot is free again once its own batch is on disk.
DEMOTE_BATCH_BYTES = 32 << 20

_NO_DIGESTS = np.empty((0, 2), dtype=np.uint64)  # a plan's digests with reuse off


class CacheManager:
    """Block bookkeeping of one rank over up to three tiers: sequences and admission
    here, slots in a :class:`~kvdist.block_pool.BlockPool`; copies go through a
    :class:`~kvdist.transfer.TransferEngine` bound to ``executor``."""

    def __init__(self, layout: KVLayout, capacity: tuple[int, int, int], executor: Executor, *,
                 enable_reuse: bool = True, offload_min_priority: int = 0, demote_ahead: int = 0,
                 drop_behind_disk: bool = False,
                 engine_seams: EngineSeams | None = None, table_rows: int = DEFAULT_ROWS,
                 recompute_when_faster: bool = True):
        assert capacity[GPU] > 0, "the GPU tier needs at least one block"
        self.layout = layout
        self.tpb = layout.tokens_per_block
        self.layered = executor.layered  # S5 per layer (kv_pool) rather than at block_table
        self.space = SlotSpace(capacity)
        self.meta = BlockMeta(self.space.total)
        self.index = PrefixIndex(self.space.total, self.meta)
        bpb = layout.bytes_per_block
        limits = {DEMOTE: max(1, DEMOTE_BATCH_BYTES // bpb),  # see DEMOTE_BATCH_BYTES
                  RELOAD: bounce_blocks(bpb), SPILL: bounce_blocks(bpb)}  # one bounce buffer each
        self.engine = TransferEngine(self.space, executor, seams=engine_seams or EngineSeams(),
                                     block_id=self._block_id, batch_limits=limits)
        self.enable_reuse = enable_reuse
        self.demote_ahead = demote_ahead if capacity[HOST] and capacity[DISK] else 0
        self.salt = layout.hash_salt()
        self.policy = RecomputePolicy(layout.bytes_per_block, self.tpb, recompute_when_faster)
        self.counters = CacheCounters()
        self.pool = BlockPool(self.space, self.meta, self.index, self.engine, self.policy,
                              self.counters, offload_min_priority,
                              drop_behind_disk=drop_behind_disk and self.demote_ahead > 0)
        self.seqs: dict[Hashable, Sequence] = {}
        self.host_table = TableRows(rows=table_rows)  # persistent rows; step tables are gathered from it
        self._dirty: dict[Hashable, Sequence] = {}  # sequences that got tokens this step
        self._deferred_release: list[Sequence] = []
        self._epoch = 0  # end_steps (with the pool's generation: see generation)
        self._transfer_seconds = 0.0
        self.bookkeeping_seconds = 0.0

    # -- helpers ----------------------------------------------------------------------------
    def _block_id(self, slot: int) -> tuple[int, int]:
        return self.meta.hi_mv[slot], self.meta.lo_mv[slot]

    def has_tier(self, tier: int) -> bool:
        return self.space.capacity[tier] > 0

    @property
    def free(self) -> list:
        """Each tier's free list (the pool's; read-only here)."""
        return self.pool.free

    @property
    def lru(self) -> list[PriorityLRU]:
        """Each tier's eviction list (the pool's; read-only here)."""
        return self.pool.lru

    @property
    def host_observer(self) -> HostObserver | None:
        """Told when a host slot gets or loses its block (the remote tier's stamps and
        directory); None when nobody listens."""
        return self.pool.host_observer

    @host_observer.setter
    def host_observer(self, observer: HostObserver | None) -> None:
        self.pool.host_observer = observer

    @property
    def transfer_seconds(self) -> float:
        """Time handing copies to the engine and running its step-boundary work."""
        return self._transfer_seconds + self.pool.transfer_seconds

    @property
    def generation(self) -> int:
        """Grows with every change an admission plan depends on: the pool's slots and
        reference counts (``BlockPool.generation``) and, at end_step, the recompute policy's
        figures."""
        return self._epoch + self.pool.generation

    def block_hashes(self, tok: array) -> list[int]:
        """The chained hashes of the full blocks of the int32 token ids ``tok``."""
        return chain_hashes(self.salt, memoryview(tok).cast("B"), 0, len(tok) // self.tpb, self.tpb)

    def _digests(self, tok: array) -> np.ndarray:
        """``block_hashes`` as ``chain_digests`` rows (hash halves), computed in one pass."""
        return chain_digests(self.salt, memoryview(tok).cast("B"), 0, len(tok) // self.tpb, self.tpb)

    def _reusable_prefix(self, digests: np.ndarray,
                         n_tokens: int) -> tuple[np.ndarray, np.ndarray | None, int]:
        """(the int64 slots of the cached prefix worth reusing: the recompute policy's
        cut; the tier of each matched block, None when all are on the GPU; blocks
        matched) for a prompt of ``n_tokens`` whose full blocks hash to ``digests``."""
        hits = self.index.match_digests(digests[: max(n_tokens - 1, 0) // self.tpb])
        base = self.space.base
        if not len(hits) or hits.max() < base[HOST]:
            return hits, None, len(hits)
        tiers = (hits >= base[HOST]).astype(np.int64) + (hits >= base[DISK])
        return hits[: self.policy.cut(tiers)], tiers, len(hits)

    # -- the step API ----------------------------------------------------------------------------
    def begin_step(self) -> None:
        t0 = time.perf_counter()
        self.engine.begin_step()
        self._transfer_seconds += time.perf_counter() - t0

    def add_sequence(self, seq_id: Hashable, tokens: Iterable[int], priority: int = DEFAULT_PRIORITY) -> int:
        """Admit a prompt: reuse its longest cached prefix of whole blocks from any tier
        (leaving at least one token to compute), allocate GPU blocks for the rest.
        Returns the number of prompt tokens reused. ``plan`` then ``commit``."""
        return self.commit(self.plan(seq_id, tokens, priority))

    # -- admission: plan, then commit ---------------------------------------------------------------
    def plan(self, seq_id: Hashable, tokens: Iterable[int],
             priority: int = DEFAULT_PRIORITY) -> AdmissionPlan:
        """What admitting the prompt would do now (changes nothing): its block hashes,
        the cached prefix worth reusing (the recompute policy's cut), the GPU slots it needs
        and can have. Raises ValueError for a sequence already admitted, a priority
        outside 0..100 or no tokens."""
        t0 = time.perf_counter()
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} is already in the cache")
        if isinstance(priority, bool) or not isinstance(priority, int) or \
                not 0 <= priority < NUM_PRIORITIES:
            raise ValueError(f"priority must be an int in 0..{NUM_PRIORITIES - 1}, got {priority!r}")
        tok = token_array(tokens)
        if not tok:
            raise ValueError(f"sequence {seq_id!r} has no tokens")
        # Every full block's hash at once: the leading ones find the reusable prefix, the
        # rest go into their fresh slots' meta at commit and into the index at end_step.
        digests = self._digests(tok) if self.enable_reuse else _NO_DIGESTS
        plan = self._plan(seq_id, tok, priority, digests)
        self.bookkeeping_seconds += time.perf_counter() - t0
        return plan

    def refresh(self, plan: AdmissionPlan) -> AdmissionPlan:
        """``plan`` if it is still current, else its prompt planned again against the
        cache as it is now (its hashes kept)."""
        if plan.generation == self.generation:
            return plan
        t0 = time.perf_counter()
        out = self._plan(plan.seq_id, plan.tokens, plan.priority, plan.digests)
        self.bookkeeping_seconds += time.perf_counter() - t0
        return out

    def _plan(self, seq_id: Hashable, tok: array, priority: int, digests: np.ndarray) -> AdmissionPlan:
        n = len(tok)
        hits, tiers, matched = self._reusable_prefix(digests, n)
        on_gpu = hits if tiers is None else hits[hits < self.space.base[HOST]]
        pinned = int((self.meta.refcnt[on_gpu] == 0).sum())  # GPU hits counted as evictable now
        reusable = max(n - 1, 0) // self.tpb if len(digests) else 0
        return AdmissionPlan(seq_id, tok, priority, digests, reusable, matched, hits, tiers,
                             len(on_gpu), -(-n // self.tpb) - len(on_gpu),
                             self.pool.available(GPU) - pinned, self.generation)

    def commit(self, plan: AdmissionPlan) -> int:
        """Admit ``plan``'s prompt as planned: pin its hits, take fresh GPU slots (the
        cascade evicting), onboard its host and disk hits. Returns the prompt tokens
        reused. Raises OutOfBlocksError (nothing changed) when it does not ``fit``. The
        plan must be current (``generation``): ``refresh`` one the cache moved past."""
        assert plan.generation == self.generation, \
            f"the plan of sequence {plan.seq_id!r} is stale: the cache changed since (refresh it)"
        t0 = time.perf_counter()
        if not plan.fits:
            raise OutOfBlocksError(plan.need, plan.available,
                                   f"sequence {plan.seq_id!r} ({len(plan.tokens)} tokens)")
        hits, priority, tpb = plan.hits, plan.priority, self.tpb
        if plan.hit_tiers is not None:
            self.policy.record(plan.hit_tiers, len(hits))
        pool = self.pool
        pool.pin(hits, priority)  # first, so the cascade below cannot evict them
        fresh = pool.allocate(plan.need, priority)
        self.counters.hit_tokens[GPU] += plan.on_gpu * tpb
        if plan.on_gpu == len(hits):
            slots = np.concatenate((hits, fresh))
        else:
            slots = self._onboard(hits, fresh, priority)
        digests, k = plan.digests, len(hits)
        if len(digests) > k:  # the fresh blocks' hashes, into their slots' meta
            self._write_hashes(slots[k:len(digests)], digests[k:])
        parent = digests[-1].tobytes() if len(digests) else self.salt
        seq = Sequence(plan.seq_id, plan.tokens, slots.tolist(), priority, len(digests), parent, k)
        self.seqs[seq.seq_id] = self._dirty[seq.seq_id] = seq
        self.counters.prompt_tokens += len(plan.tokens)
        self.bookkeeping_seconds += time.perf_counter() - t0
        return len(hits) * tpb

    def _onboard(self, h: np.ndarray, fresh: np.ndarray, priority: int) -> np.ndarray:
        """The prompt's slots: GPU hits ``h`` as they are, host and disk hits moved into
        the first ``k`` of ``fresh`` (the lowest source into the lowest slot), then the
        rest of ``fresh``."""
        cold = h >= self.space.base[HOST]
        k = int(cold.sum())
        slots = h.copy()
        # Ascending sources into ascending fresh slots: adjacent host slots (an
        # offload's run, ``BlockPool._offload_run``) come back as one coalesced copy.
        order = np.argsort(h[cold], kind="stable")
        into = np.empty(k, dtype=np.int64)
        into[order] = np.sort(fresh[:k])
        slots[cold] = into
        on_disk = h >= self.space.base[DISK]
        for tier, pick in ((HOST, cold & ~on_disk), (DISK, on_disk)):  # no slot in both runs: order is free
            srcs = h[pick]
            if len(srcs):
                self.counters.hit_tokens[tier] += len(srcs) * self.tpb
                # The destinations keep the reference allocate gave them.
                self.pool.move_run(srcs, slots[pick], route(tier, GPU))
        moved = fresh[:k]
        prio = self.meta.prio
        prio[moved] = np.maximum(prio[moved], priority)
        self.pool.submit_moves()
        return np.concatenate((slots, fresh[k:]))

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
        hits, tiers, _ = self._reusable_prefix(self._digests(tok), len(tok))
        if tiers is None or not (tiers == DISK).any():
            return 0
        promoted = self.pool.promote([(s, t) for s, t in zip(hits.tolist(), tiers.tolist()) if t != GPU])
        self.bookkeeping_seconds += time.perf_counter() - t0
        return promoted

    def append_tokens(self, seq_id: Hashable, tokens: Iterable[int]) -> None:
        """Grow a sequence by decoded tokens (their K/V is written in this step)."""
        t0 = time.perf_counter()
        seq = self._get(seq_id)
        tok = token_array(tokens)  # the whole input first: a bad id changes nothing
        need = -(-(len(seq.tokens) + len(tok)) // self.tpb) - len(seq.slots)
        if need > 0:
            available = self.pool.available(GPU)
            if need > available:
                raise OutOfBlocksError(need, available, f"appending to sequence {seq_id!r}")
            seq.slots.extend(self.pool.allocate(need, seq.priority).tolist())
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
        self._transfer_seconds += time.perf_counter() - t0

    def before_layer(self, layer: int) -> None:
        """S5 for one layer: compute waits for the copies of that layer's group."""
        if self.layered:
            self.engine.before_layer(layer)

    def end_step(self) -> None:
        """Blocks filled in this step enter the prefix index; deferred releases run."""
        t0 = time.perf_counter()
        self._epoch += 1  # plans do not outlive a step: the recompute policy's figures change here
        if self.enable_reuse:
            tpb = self.tpb
            for seq in chain(self._dirty.values(), self._deferred_release):
                if len(seq.tokens) // tpb > seq.num_indexed:
                    self._register_full_blocks(seq)
        self._dirty.clear()
        pool = self.pool
        for seq in self._deferred_release:
            pool.unpin(seq.slots)
        self._deferred_release.clear()
        for copied, nbytes, seconds in self.engine.executor.take_timings():  # onboards, reloads
            self.policy.observe_copy(copied.src, nbytes, seconds)
        if pool.free_count(HOST) < self.demote_ahead and self.policy.worth_storing(DISK):
            # Writes start now and run during the next forward pass, so the next
            # step's offloads land in host slots no disk write is still reading.
            pool.make_free(HOST, self.demote_ahead)
            self.engine.flush()
        self.counters.steps += 1
        self.bookkeeping_seconds += time.perf_counter() - t0

    def local_host_ready(self) -> list[int]:
        """The host slots ready for offloads on this rank (``BlockPool.host_ready``), as a
        figure for the TP group's MIN at end_step; [] when offloads never drop."""
        return [self.pool.local_host_ready()] if self.pool.drop_behind_disk else []

    def agree_host_ready(self, agreed: list[int]) -> None:
        """The TP group's MIN of ``local_host_ready`` (the same list shape)."""
        if agreed:
            self.pool.host_ready = agreed[0]

    def _register_full_blocks(self, seq: Sequence) -> None:
        full = len(seq.tokens) // self.tpb
        slots = seq.slots
        if full > seq.num_hashed:  # blocks filled by decode: hash them now
            digests = chain_digests(seq.parent, memoryview(seq.tokens).cast("B"), seq.num_hashed,
                                    full - seq.num_hashed, self.tpb)
            self._write_hashes(slots[seq.num_hashed : full], digests)
            seq.num_hashed = full
            seq.parent = digests[-1].tobytes()
        start = seq.num_indexed
        self.pool.register(slots[start:full])
        observer = self.pool.block_log
        if observer is not None:
            tpb = self.tpb
            log_registered(observer, self.meta, slots, start, full, seq.tokens[start * tpb : full * tpb])
        seq.num_indexed = full

    def _write_hashes(self, slots, digests: np.ndarray) -> None:
        """Each of ``slots`` (a list or an int array) holds the block of the same row of
        ``digests``."""
        at = np.asarray(slots, dtype=np.int64)
        self.meta.hash_lo[at] = digests[:, 0]
        self.meta.hash_hi[at] = digests[:, 1]

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
            self.pool.unpin(seq.slots)

    def _get(self, seq_id: Hashable) -> Sequence:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}") from None

    def synchronize(self) -> None:
        t0 = time.perf_counter()
        self.engine.synchronize()
        self._transfer_seconds += time.perf_counter() - t0

    # -- observability ---------------------------------------------------------------------------
    def tier_names(self) -> tuple[str, ...]:
        return tuple(TIER_NAMES[t] for t in (GPU, HOST, DISK) if self.has_tier(t))

    def usage(self) -> dict[str, tuple[int, int]]:
        """{tier: (used, free)} blocks."""
        free = self.pool.free_count
        return {TIER_NAMES[t]: (self.space.capacity[t] - free(t), free(t))
                for t in (GPU, HOST, DISK) if self.has_tier(t)}

    def metadata_bytes(self) -> int:
        """Bytes of the per-slot arrays: block metadata, prefix index, free lists and
        the transfer engine's per-slot tracking."""
        return self.meta.nbytes + self.index.nbytes + self.pool.nbytes + self.engine.nbytes

    def _checked(self) -> manager_checks.ManagerState:
        return manager_checks.ManagerState(self.meta, self.space, self.index, self.pool.snapshot(),
                                           self.tpb, self.seqs, list(self._dirty), self._deferred_release)

    def state_digest(self) -> bytes:
        """xxh3-128 of the state that decides this cache's future behaviour (see
        :func:`~kvdist.manager_checks.state_digest`)."""
        return manager_checks.state_digest(self._checked())

    def check_invariants(self) -> None:
        """Verify the invariants of the module docstring, the pool's and the transfer
        engine's (O(total slots))."""
        self.pool.check_invariants()
        manager_checks.check_invariants(self._checked())
        self.engine.check_invariants()
