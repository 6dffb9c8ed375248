"""The scheduler's side of ``cache.gpu: external``: which of a prompt's blocks kvdist
holds beyond the engine's own GPU hit, which host or disk slot each saved block goes
to, and the eviction cascade among kvdist's tiers, all as bookkeeping (no tensors, no
MPI, no copies). Every decision is queued as copies in one ordered list
(:class:`~kvdist.external.plan.Transfers`) that the engine ships to every worker rank in
its per-step metadata; each worker issues them in that order. One planner decides for
all TP ranks, so they reuse the same blocks by construction (rule R1).

Ask, then commit (nano-vllm's ``can_allocate`` / ``allocate``): ``lookup`` changes
nothing; ``plan_load`` queues the loads of the blocks still held (those that left kvdist
since the lookup are reported ``failed``); ``saveable`` changes nothing; ``plan_save``
takes slots (evicting colder) and queues the saves. A load copies: the block stays in
its tier. A slot's reuse is ordered after every copy reading it by the workers'
transfer engines (rule S2), so the planner never waits for a copy to complete.

State (``check_invariants``): the slots of the host and disk tiers in a
:class:`~kvdist.block_pool.BlockPool` (free lists, eviction lists, the prefix index),
numbered as ``TierPlan`` says (host ``[0, H)``, disk ``[H, H + D)``); the copies queued
since the last ``take``."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

import xxhash

from ..block_pool import BlockPool
from ..blocks import DISK, HOST, NO_SLOT, BlockMeta, SlotSpace
from ..config import CacheConfig, load_config
from ..counters import CacheCounters
from ..errors import HostTierUnavailable
from ..eviction import DEFAULT_PRIORITY
from ..layout import KVLayout
from ..prefix import PrefixIndex, chain_hashes, token_bytes
from ..recompute_policy import RecomputePolicy
from ..transfer import OFFLOAD, ONBOARD, RELOAD, ROUTES, SPILL, Route
from .plan import LOAD, SAVE, Fetch, Job, LoadPlan, Prompt, SavePlan, TierPlan, Transfers

__all__ = ["ExternalPlanner", "PeerLookup", "tier_plan"]


class PeerLookup(Protocol):
    """What the planner asks of the remote tier (``kvdist.external.peers.PeerTier``):
    the (replica, its host slot) of the longest run of leading ``hashes`` other
    replicas hold, as this replica's TP ranks all see it (rule R4)."""

    def holders(self, hashes: list[int]) -> list[tuple[int, int]]: ...

_ROUTE_ID = {r: i for i, r in enumerate(ROUTES)}


def tier_plan(cfg: CacheConfig) -> TierPlan:
    """The tiers the config asks for, in blocks (what every rank plans at start-up)."""
    layout = KVLayout.from_config(cfg)
    c = cfg.cache
    disk = layout.blocks_in(c.disk.bytes) if c.disk.path else 0
    return TierPlan(layout.blocks_in(c.host.bytes), disk)


class _Recorder:
    """Stands in for the transfer engine under the pool: the cascade's moves (demotions)
    become rows of the copy list, tier-local, belonging to no job."""

    def __init__(self, space: SlotSpace, rows: list[tuple[int, int, int, int]]):
        self.base, self.rows = space.base, rows

    def copy(self, route: Route, src: int, dst: int) -> None:
        self.rows.append((_ROUTE_ID[route], src - self.base[route.src], dst - self.base[route.dst], -1))

    def copy_many(self, route: Route, srcs, dsts) -> None:
        for s, d in zip(srcs, dsts):
            self.copy(route, int(s), int(d))


class ExternalPlanner:
    """Bookkeeping of kvdist's host and disk tiers for an engine that owns the GPU tier
    (see the module docstring). Not thread-safe: the engine's scheduler drives it."""

    def __init__(self, cfg: CacheConfig | dict | str, tiers: TierPlan | None = None,
                 peers: PeerLookup | None = None):
        """``peers``: the remote tier of the worker rank in this process (every TP rank
        runs its own planner: vLLM's external_launcher); None: host and disk alone."""
        cfg = load_config(cfg)
        self.peers = peers
        assert cfg.cache.gpu == "external", "ExternalPlanner is for cache.gpu: external"
        self.layout = KVLayout.from_config(cfg)
        self.tpb = self.layout.tokens_per_block
        self.policy = RecomputePolicy(self.layout.bytes_per_block, self.tpb, cfg.cache.recompute_when_faster)
        self._salt = self.layout.hash_salt()
        self._rows: list[tuple[int, int, int, int]] = []
        self._jobs: list[Job] = []
        self._filled: list[tuple[int, int]] = []  # host slots saves fill, and their hashes
        self._fetches: list[Fetch] = []
        self.remote_hit_tokens = 0  # tokens planned to load from other replicas
        self._number(tiers if tiers is not None else tier_plan(cfg))

    def _number(self, tiers: TierPlan) -> None:
        """Slots, prefix index and pool over ``tiers`` (host ``[0, H)``, disk after)."""
        self.tiers = tiers
        self.space = SlotSpace((0, tiers.host_blocks, tiers.disk_blocks))
        assert self.space.total > 0, "kvdist keeps no tier: nothing to plan"
        self.meta = BlockMeta(self.space.total)
        self.index = PrefixIndex(self.space.total, self.meta)
        self.counters = CacheCounters()
        self.pool = BlockPool(self.space, self.meta, self.index, _Recorder(self.space, self._rows),
                              self.policy, self.counters)
        self._save_tier = HOST if tiers.host_blocks else DISK

    def adopt(self, tiers: TierPlan) -> None:
        """Number slots in the tiers the workers committed (``ExternalCache.tier_plan``;
        after ``USE_NO_HOST`` there is no host tier), before anything is planned: the
        engine hands them over at start-up. Raises HostTierUnavailable when that leaves
        kvdist no tier."""
        if tiers == self.tiers:
            return
        assert not self._rows and not self._jobs and all(
            self.pool.free_count(t) == self.space.capacity[t] for t in (HOST, DISK)), \
            "adopt the workers' tiers before planning"
        if not tiers.host_blocks and not tiers.disk_blocks:
            raise HostTierUnavailable(f"the host tier could not be had on some worker ({tiers}) and no disk "
                                      f"tier is configured (cache.disk): kvdist keeps no tier")
        self._number(tiers)

    # -- prompts -------------------------------------------------------------------------------
    def prompt(self, tokens: Sequence[int]) -> Prompt:
        """A prompt keyed by kvdist's chained hashes of its tokens' full blocks."""
        tok = token_bytes(tokens)
        full = len(tok) // (4 * self.tpb)
        return Prompt(len(tok) // 4, tuple(chain_hashes(self._salt, tok, 0, full, self.tpb)))

    def prompt_of_keys(self, keys: Sequence[bytes], num_tokens: int) -> Prompt:
        """A prompt of ``num_tokens`` keyed by the engine's own chained block keys, one
        per full block (vLLM's block hashes: they cover what the tokens do not, LoRA
        adapters and multimodal inputs), hashed with kvdist's geometry salt."""
        assert len(keys) <= num_tokens // self.tpb, f"{len(keys)} block keys for {num_tokens} tokens"
        return Prompt(num_tokens, tuple(xxhash.xxh3_128_intdigest(self._salt + bytes(k)) for k in keys))

    def _prompt(self, prompt: Prompt | Sequence[int]) -> Prompt:
        return prompt if isinstance(prompt, Prompt) else self.prompt(prompt)

    def _held(self, hashes: list[int], first: int) -> tuple[int, int]:
        """(blocks here, blocks another replica holds after them) of the longest run of
        ``hashes[first:]``, cut where loading stops paying (the recompute policy; a
        remote block is priced as a host onboard, its cheapest)."""
        slots = self.index.match(hashes[first:])
        tiers = [self.space.tier_of(s) for s in slots]
        if self.peers is not None:
            tiers += [HOST] * len(self.peers.holders(hashes[first + len(slots):]))
        k = self.policy.cut(tiers) if tiers else 0
        return min(k, len(slots)), max(k - len(slots), 0)

    # -- loads ------------------------------------------------------------------------------------
    def lookup(self, prompt: Prompt | Sequence[int], gpu_hit_tokens: int = 0) -> int:
        """Tokens after the engine's own GPU hit (``gpu_hit_tokens``, whole blocks) that
        kvdist holds in its host and disk tiers (and, with the remote tier, other
        replicas do) and that are worth loading rather than computing; never the whole
        prompt (one token is always left to compute). Changes nothing."""
        return sum(self.lookup_split(prompt, gpu_hit_tokens))

    def lookup_split(self, prompt: Prompt | Sequence[int], gpu_hit_tokens: int = 0) -> tuple[int, int]:
        """``lookup``'s tokens as (this replica's tiers', other replicas'): the engine
        loads the latter asynchronously (they complete at a later step boundary)."""
        assert gpu_hit_tokens % self.tpb == 0, f"a GPU hit of {gpu_hit_tokens} tokens is not whole blocks"
        p = self._prompt(prompt)
        usable = min(max(p.num_tokens - 1, 0) // self.tpb, len(p.hashes))
        first = gpu_hit_tokens // self.tpb
        if first >= usable:
            return 0, 0
        here, remote = self._held(list(p.hashes[:usable]), first)
        return here * self.tpb, remote * self.tpb

    def plan_load(self, request_id: Hashable, prompt: Prompt | Sequence[int], engine_blocks: Sequence[int],
                  gpu_hit_tokens: int = 0) -> LoadPlan:
        """Queue loads into ``engine_blocks`` (the engine's block ids for the blocks
        right after its GPU hit, one per block ``lookup`` counted): each gets the block
        kvdist holds for that position, from this replica's tiers or, after them, from
        the replica the directory names (a ``Fetch``). Blocks no one holds any more are
        ``failed``."""
        assert gpu_hit_tokens % self.tpb == 0, f"a GPU hit of {gpu_hit_tokens} tokens is not whole blocks"
        first = gpu_hit_tokens // self.tpb
        want = list(engine_blocks)
        hashes = list(self._prompt(prompt).hashes[first:first + len(want)])
        slots = self.index.match(hashes)
        job = len(self._jobs)
        tiers = [self.space.tier_of(s) for s in slots]
        self.policy.record(tiers, len(tiers))  # stats: cold blocks loaded, by tier
        for s, tier, e in zip(slots, tiers, want):
            route = ONBOARD if tier == HOST else RELOAD
            self._rows.append((_ROUTE_ID[route], s - self.space.base[tier], e, job))
            self.counters.hit_tokens[tier] += self.tpb
        self._touch(hashes[:len(slots)])
        n = local = len(slots)
        if self.peers is not None and n < len(want):
            held = self.peers.holders(hashes[n:])
            if held:
                peers, at = zip(*held)
                self._fetches.append(Fetch(job, peers, at, tuple(hashes[n:n + len(held)]),
                                           tuple(want[n:n + len(held)])))
                self.remote_hit_tokens += len(held) * self.tpb
                n += len(held)
        loaded, failed = tuple(want[:n]), tuple(want[n:])
        self._jobs.append(Job(request_id, LOAD, loaded, failed))
        return LoadPlan(request_id, loaded, failed, n * self.tpb, n - local)

    # -- saves --------------------------------------------------------------------------------------
    def saveable(self, prompt: Prompt | Sequence[int], first_block: int = 0) -> int:
        """How many full blocks of the prompt from ``first_block`` on kvdist does not hold
        yet (what ``plan_save`` would copy, slots permitting). Changes nothing."""
        return sum(self.index.find(h) == NO_SLOT for h in self._prompt(prompt).hashes[first_block:])

    def plan_save(self, request_id: Hashable, prompt: Prompt | Sequence[int], engine_blocks: Sequence[int],
                  first_block: int = 0, priority: int = DEFAULT_PRIORITY) -> SavePlan:
        """Queue saves of the full blocks of the prompt from ``first_block`` on, held in
        ``engine_blocks`` (one per block, in order), that kvdist does not hold yet: each
        takes a slot of the warmest tier kvdist keeps, evicting that tier's coldest block
        one tier colder (or dropping it). A block with no slot to be had is dropped."""
        hashes = self._prompt(prompt).hashes[first_block:first_block + len(engine_blocks)]
        tier = self._save_tier
        route = OFFLOAD if tier == HOST else SPILL
        job, saved, held, dropped = len(self._jobs), [], 0, 0
        for h, e in zip(hashes, engine_blocks):
            if self.index.find(h) != NO_SLOT:
                held += 1
                continue
            s = self.pool.reserve(tier)
            self.pool.submit_moves()  # the eviction's copies first: they read the slot's old block
            if s == NO_SLOT:
                dropped += 1
                continue
            self._rows.append((_ROUTE_ID[route], int(e), s - self.space.base[tier], job))
            if tier == HOST:
                self._filled.append((s - self.space.base[HOST], h))
            landed = self.pool.land(s, h, priority)
            assert landed, "a hash not indexed a moment ago is indexed"
            saved.append(int(e))
            self.counters.blocks_moved[route.name] += 1
        self._touch(hashes)
        self._jobs.append(Job(request_id, SAVE, tuple(saved)))
        return SavePlan(request_id, tuple(saved), held, dropped)

    def _touch(self, hashes) -> None:
        """The prompt's blocks kvdist holds become their tiers' most recently used, the
        tail first: a prefix is evicted from its end."""
        lru, find, tier_of = self.pool.lru, self.index.find, self.space.tier_of
        for h in reversed(hashes):
            s = find(h)
            if s != NO_SLOT:
                t = tier_of(s)
                lru[t].remove(s)
                lru[t].push(s)
    # -- shipping -----------------------------------------------------------------------------------
    def take(self) -> Transfers:
        """The copies queued since the last call, in order, and their jobs (for the
        engine's per-step metadata); the planner starts a new list."""
        out = Transfers.of(self.tiers, self._rows, self._jobs, self._filled, self._fetches)
        self._rows.clear()
        self._jobs.clear()
        self._filled.clear()
        self._fetches.clear()
        return out

    def agree(self, figures: list[int]) -> None:
        """Adopt the workers' recompute-policy figures (``ExternalCache.figures``, the
        MIN over the TP ranks): from now on ``lookup`` cuts where loading stops paying."""
        self.policy.agree(figures)

    # -- observability ------------------------------------------------------------------------------
    def stats(self) -> dict:
        free = self.pool.free_count
        cap = self.space.capacity
        tiers = {"host": HOST, "disk": DISK}
        return {"blocks_used": {n: cap[t] - free(t) for n, t in tiers.items() if cap[t]},
                "blocks_free": {n: free(t) for n, t in tiers.items() if cap[t]},
                "hit_tokens": {n: self.counters.hit_tokens[t] for n, t in tiers.items() if cap[t]},
                "blocks_moved": dict(self.counters.blocks_moved),
                **({"remote_hit_tokens": self.remote_hit_tokens} if self.peers is not None else {}),
                "evictions": sum(self.counters.evictions), "dropped": self.counters.dropped,
                "recompute_policy": self.policy.stats(lambda t: cap[t] > 0)}

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        self.index.check_invariants()
