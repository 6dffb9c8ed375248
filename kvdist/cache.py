"""The public façade: ``kvdist.create`` runs the start-up protocol over the library's
communicator and returns a :class:`KVCache`, the per-rank cache an engine drives
step by step (docs/design.md, "Public API")."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import numpy as np
import torch

from .blocks import TIER_NAMES
from .candidate import CandidateBuilder, RankCache
from .config import CacheConfig, load_config
from .distributed import comm as dist_comm
from .distributed import remote_setup
from .distributed.consensus import Committed, InitStatus, InitTiming, establish, outliers
from .distributed.remote import RemoteTier
from .distributed.replicas import ReplicaComms, ReplicaLayout
from .errors import CacheClosedError, ConfigError, ConsistencyError, StepOrderError
from .eviction import DEFAULT_PRIORITY
from .landing import ManagerSlots
from .layout import KVLayout
from .loads import DiskLoads
from .seams import Seams
from .transfer import PROMOTE, SimulatedCompute

__all__ = ["KVCache", "create"]

_CLOSED_MESSAGE = "the cache is closed: close() freed its tiers; create a new one"


class _Closed:
    """Stands in for the parts of a closed cache: any use raises CacheClosedError."""

    __slots__ = ()

    def __getattr__(self, name: str):
        raise CacheClosedError(_CLOSED_MESSAGE)


_CLOSED = _Closed()


class KVCache:
    """One rank's tiered, paged KV cache. Not thread-safe: one scheduler thread drives it.

    A step is ``begin_step``, then any ``add_sequence`` / ``append_tokens`` and one or
    more ``block_table``, then ``end_step``. One of those scheduling calls made between
    steps opens a step itself, as ``begin_step`` would; ``begin_step`` while a step is
    open and ``end_step`` without one raise StepOrderError (nothing changed).
    ``release``, ``stats`` and the checks work at any time. After ``close()`` every call
    but ``close()`` raises CacheClosedError."""

    __slots__ = ("_check_every", "_checks_passed", "_closed", "_comm", "_in_step", "_init", "_loads",
                 "_manager", "_parts", "_remote", "_replicas", "_stager", "config", "device", "init_status",
                 "num_replicas", "rank", "replica", "tiers", "tp_rank", "tp_size", "world_size")

    def __init__(self, parts: RankCache, comm, status: InitStatus, init: Committed | None = None,
                 replicas: ReplicaComms | None = None, remote: RemoteTier | None = None):
        self._parts = parts
        self._init = init
        self._comm = comm
        if replicas is None:
            replicas = ReplicaComms(comm, ReplicaLayout.of(comm.rank, comm.size, 0))
        self._replicas = replicas
        where = replicas.layout
        self.replica: int = where.replica  # this rank's replica (0 .. num_replicas - 1)
        self.num_replicas: int = where.num_replicas
        self.tp_rank: int = where.tp_rank  # this rank's place in its replica's TP group
        self.tp_size: int = where.tp_size
        self._manager = parts.manager
        self._stager = parts.stager
        self._loads = DiskLoads(parts.manager.engine.executor)  # prefetches' disk reads in flight
        self.rank: int = comm.rank
        self.world_size: int = comm.size
        self.init_status: InitStatus = status
        self.device: torch.device = parts.device
        self._remote = remote  # the remote tier (None: not committed)
        self.tiers: tuple[str, ...] = parts.tiers + (("remote",) if remote is not None else ())
        self.config: CacheConfig = parts.cfg
        self._check_every = parts.cfg.distributed.check_consistency_every
        self._closed = False
        self._in_step = False
        self._checks_passed = 0

    # -- one scheduler step -----------------------------------------------------------------
    def begin_step(self) -> None:
        """Start a step: the copy streams wait for the compute stream (S4)."""
        manager = self._live()
        if self._in_step:
            raise StepOrderError("begin_step: the previous step is still open (call end_step first)")
        remote = self._remote
        if remote is not None:
            remote.begin_step()
        manager.begin_step()
        if remote is not None:
            remote.start_deferred()
        self._in_step = True

    def add_sequence(self, seq_id: Hashable, tokens: Iterable[int],
                     priority: int = DEFAULT_PRIORITY) -> int:
        """Admit a prompt; returns how many of its tokens are reused from the cache.
        Raises OutOfBlocksError (nothing changed) when it cannot fit. With the remote
        tier, blocks only other replicas hold are fetched first (waiting at most
        ``fetch_timeout_ms``) unless ``prefetch`` started them."""
        manager = self._scheduling()
        plan = manager.plan(seq_id, tokens, priority)  # raises for a bad id, priority or tokens
        remote = self._remote
        if remote is None:
            reused = manager.commit(plan)
            self._loads.forget(seq_id)
            return reused
        landed = remote.before_add(plan)  # fetches the plan's remote part when it fits
        reused = manager.commit(manager.refresh(plan))  # planned again if fetching changed the cache
        if landed:  # the plan's hashes as ints only when some of its blocks were fetched for it
            remote.after_add(plan.hashes, landed, reused)
        self._loads.forget(seq_id)
        return reused

    def append_tokens(self, seq_id: Hashable, tokens: Iterable[int]) -> None:
        """Grow a sequence by decoded tokens whose K/V this step writes."""
        self._scheduling().append_tokens(seq_id, tokens)

    def block_table(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        """int32 ``[len(seq_ids), max blocks]`` on ``device``, rows padded with -1. Ends
        scheduling for the step: compute waits for the copies queued so far (S5)."""
        manager = self._scheduling()
        if isinstance(seq_ids, str | bytes):
            raise TypeError(f"block_table takes a list of sequence ids, not the {type(seq_ids).__name__} "
                            f"{seq_ids!r} (wrap one id in a list)")
        # Gathered straight into a staging slot, copied from there (S3): later host
        # writes to the scheduler's rows or to the next step's table cannot reach it.
        # S5 first: where the host is the compute stream (CPU, simulated streams), the
        # table copy runs the compute work queued before it, which must follow the copies.
        stager = self._stager
        rows = manager.table_rows(list(seq_ids), stager.host_buffer)
        # The copies queued so far are submitted before this step's rows are marked: they
        # follow only the kernels of earlier steps that use their slots (S4), not this
        # step's compute event, which stands for the whole previous forward pass.
        manager.engine.flush()
        manager.engine.compute_uses(rows)  # S4: later copies touching these slots wait for the kernels
        manager.before_compute()
        return stager.upload_buffer(rows)

    def stage(self, array: np.ndarray, stream=None) -> torch.Tensor:
        """A device copy of ``array`` (gather indices, scratch metadata) that later host
        writes cannot corrupt (S3): the caller may rewrite ``array`` at once. Valid on
        ``stream`` (the current stream by default) once the queued copy has run there."""
        return self._stager.stage(array, stream)

    def kv_pool(self, layer: int) -> torch.Tensor:
        """``[num_gpu_blocks, 2, tokens_per_block, kv_heads, head_dim]``: K at index 0 of
        dim 1, V at index 1. With copies by layer group (``cache.layer_groups`` > 1)
        this is where the compute stream waits for the step's copies of that layer
        (rule S5 per layer): take each layer's pool in the step that reads it."""
        pool = self._parts.gpu.kv_pool(layer)  # raises IndexError for a layer out of range
        self._live().before_layer(layer)
        return pool

    def end_step(self) -> None:
        """Blocks filled in this step become reusable."""
        manager = self._live()
        if not self._in_step:
            raise StepOrderError("end_step without begin_step")
        self._in_step = False
        manager.end_step()
        policy = manager.policy
        # Timing-dependent figures differ per rank: decide from the TP group's (MIN): the
        # recompute policy's, the host slots no disk write still reads (offloads take only
        # those: BlockPool.host_ready), and which prefetches' disk reads every rank has
        # (kvdist.loads). One MIN-reduce, on which the remote tier's agreement rides.
        figures = policy.local_figures() if policy.enabled and len(self.tiers) > 1 else []
        ready = manager.local_host_ready()  # [] when offloads never drop behind the disk
        landed = self._loads.local()  # [] when no prefetch waits (alike on every rank)
        extra = figures + ready + landed if figures or ready or landed else None
        agreed = self._remote.end_step(extra) if self._remote is not None else None
        if extra is not None:
            if agreed is None:
                agreed = self._replicas.tp.allreduce_min(
                    extra, "recompute policy figures" if not landed else "step figures and disk loads")
            n, k = len(figures), len(figures) + len(ready)
            if figures:
                policy.agree(agreed[:n])
            manager.agree_host_ready(agreed[n:k])
            self._loads.agree(agreed[k:])
        if self._parts.events is not None:
            self._parts.events.end_step()  # the step's block changes: one batch, sent off the step's path
        if self._check_every and self._manager.counters.steps % self._check_every == 0:
            self.check_consistency()

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed ``tokens`` prompt tokens in ``seconds`` (a step's forward
        pass, device time included): the recompute side of the onboard-or-recompute
        decision (``cache.recompute_when_faster``). Local; agreed at ``end_step``."""
        self._live().policy.observe_prefill(tokens, seconds)

    def _live(self):
        if self._closed:
            raise CacheClosedError(_CLOSED_MESSAGE)
        return self._manager

    def _scheduling(self):
        """The manager, inside a step: a scheduling call made between steps opens one,
        exactly as ``begin_step`` would (S4 holds: its copies follow the compute stream's
        work so far)."""
        manager = self._live()
        if not self._in_step:
            self.begin_step()
        return manager

    def release(self, seq_id: Hashable) -> None:
        """The sequence is finished; its full blocks stay cached."""
        self._manager.release(seq_id)

    def prefetch(self, seq_id: Hashable, tokens: Iterable[int]) -> int:
        """Start moving a request's cached blocks closer, without blocking; returns how
        many blocks are on their way. Its disk blocks (those ``add_sequence`` would reuse
        now, by the recompute policy) move into the host tier at once, in or between steps:
        ``add_sequence`` then onboards them like host hits, after their read (rule S2).
        Its blocks that only other replicas hold (the remote tier) are pulled: a later
        ``add_sequence(seq_id, ...)`` reuses those that have landed and been agreed by the
        replica's ranks, and ``prefetch_ready`` says when every one of them has (landed or
        given up, at most ``fetch_timeout_ms`` later); called between steps, they start
        right after the next ``begin_step``. Changes the cache like ``add_sequence``: call
        it alike on every TP rank of a replica (same answer on each)."""
        manager = self._live()
        tokens = tokens if isinstance(tokens, list | tuple) else list(tokens)
        with manager.engine.collecting(PROMOTE) as reads:
            promoted = manager.prefetch(tokens)
        if promoted:  # the same on every TP rank: their caches are equal
            self._loads.start(seq_id, reads)
        if self._remote is None:
            return promoted
        return promoted + self._remote.prefetch(seq_id, tokens, now=self._in_step)

    def prefetch_ready(self, seq_id: Hashable) -> bool:
        """Whether nothing prefetched for ``seq_id`` is still on its way (True for a
        sequence never prefetched): its disk blocks' reads into the host tier are done
        on every rank of the replica, and its remote blocks landed or were given up. Changes
        only at step boundaries (``end_step`` agrees it), alike on the replica's ranks, so a
        scheduler can admit on it: that ``add_sequence`` never waits for the disk."""
        self._live()
        if self._loads.waiting(seq_id):
            return False
        return self._remote is None or self._remote.prefetch_ready(seq_id)

    def synchronize(self) -> None:
        """Block the host until every queued tier copy has run."""
        self._manager.synchronize()

    # -- observability -------------------------------------------------------------------------
    @property
    def layout(self) -> KVLayout:
        return self._parts.layout

    @property
    def simulated_compute(self) -> SimulatedCompute | None:
        """With simulated streams (``cache.simulate_async`` on CPU), the compute stream:
        queue the forward pass on it (``kernel``) so it runs behind the block table's
        copy, and ``force`` it. None on CUDA and on a plain CPU cache, where the forward
        pass simply runs."""
        return self._parts.backend.executor.simulated_compute

    def stats(self) -> dict:
        """The counters of docs/design.md ("Observability") plus per-route block counts,
        timings and the copy executor's own figures (``transfer``)."""
        m = self._manager
        c = m.counters
        bpb = self.layout.bytes_per_block
        usage = m.usage()
        moved = c.blocks_moved
        engine = m.engine
        executor = engine.executor
        waits = executor.counters
        rc = self._remote.counters if self._remote is not None else None
        return {
            "tiers": list(self.tiers),
            "init_status": self.init_status.name,
            "blocks_used": {t: u for t, (u, _) in usage.items()},
            "blocks_free": {t: f for t, (_, f) in usage.items()},
            "capacity_blocks": {t: u + f for t, (u, f) in usage.items()},
            "hit_tokens": self._hit_tokens(),
            # The remote tier (blocks of other replicas): bytes that landed here, and
            # blocks looked up that turned out stale or did not come in time.
            "bytes_fetched_remote": rc.landed * bpb if rc else 0,
            "remote_misses": rc.misses if rc else 0,
            "remote": self._remote.stats() if self._remote else {},
            "prompt_tokens": c.prompt_tokens,
            "bytes_offloaded": (moved["offload"] + moved["spill"]) * bpb,
            "bytes_onboarded": (moved["onboard"] + moved["reload"]) * bpb,
            "bytes_demoted": moved["demote"] * bpb,
            "blocks_moved": dict(moved),
            "evictions": sum(c.evictions),
            "evictions_by_tier": {TIER_NAMES[t]: c.evictions[t] for t in range(3) if m.has_tier(t)},
            "dropped": c.dropped,
            "dropped_behind_disk": c.dropped_behind_disk,
            "transfer_seconds": m.transfer_seconds,
            "bookkeeping_seconds": m.bookkeeping_seconds,
            "transfer_path": executor.path,
            "transfer_batches": engine.stats.batches,
            "transfer": executor.stats(),
            # The host blocked on unfinished disk work (a reload's read, or an offload into
            # a host slot a demotion is still reading): CUDA executor only.
            "host_waits_on_disk": waits.host_waits,
            "host_wait_seconds": waits.host_wait_seconds,
            "host_wait_read_seconds": waits.host_wait_read_seconds,  # of which on reloads' reads
            # The compute stream stood still waiting for tier copies (S5).
            "compute_wait_seconds": executor.compute_wait_seconds,
            # Prefetches whose disk reads a scheduler waited for (prefetch_ready) instead of
            # blocking on them: sequences started, still waiting, agreements that found one
            # not landed yet.
            "disk_loads": self._loads.stats(),
            # Cold hits onboarded vs recomputed because that was faster (recompute_policy).
            "recompute_policy": m.policy.stats(m.has_tier),
            "staging": self._stager.stats(),
            "sequences": len(m.seqs),
            "consistency_checks": self._checks_passed,
            "steps": c.steps,
            "block_bytes": bpb,
            "metadata_bytes": m.metadata_bytes(),
            "rank": self.rank,
            "world_size": self.world_size,
            "replica": self.replica,
            "num_replicas": self.num_replicas,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "init_seconds": self._init.timing.as_dict() if self._init else {},
            "init_failures": dict(self._init.failures) if self._init else {},
            # KV cache events (TP rank 0 of each replica, cache.events.enabled): where they
            # are published, batches sent, dropped (queue full) and replays served.
            "events": self._parts.events.stats() if self._parts.events is not None else {},
        }

    def _hit_tokens(self) -> dict[str, int]:
        """Prompt tokens reused, by the tier their blocks came from; blocks fetched from
        another replica count as "remote" (the manager saw them in the tier they landed in)."""
        m = self._manager
        hits = {TIER_NAMES[t]: m.counters.hit_tokens[t] for t in range(3) if m.has_tier(t)}
        if self._remote is not None:
            by_tier = self._remote.counters.hit_blocks
            for t, n in enumerate(by_tier):
                if n:
                    hits[TIER_NAMES[t]] -= n * m.tpb
            hits["remote"] = sum(by_tier) * m.tpb
        return hits

    def check_invariants(self) -> None:
        self._manager.check_invariants()
        if self._remote is not None:
            self._remote.check_invariants()
        self._manager.host_table.check_invariants()
        self._stager.check_invariants()

    def check_consistency(self) -> None:
        """Collective over this rank's replica (its TP group; the whole job when there is
        one replica): compare a digest of every rank's cache state (prefix index, tier
        occupancy, sequences); raise ConsistencyError on every rank of the replica,
        naming the ranks that differ from the majority, when they diverged. TP ranks fed
        the same request stream must never diverge; replicas serve different requests
        and are not compared. Runs by itself every ``distributed.check_consistency_every``
        end_steps when that is set."""
        tp = self._replicas.tp
        digests = tp.allgather(self.state_digest(), "cache state digest")
        ref, diverged = outliers(digests)
        if diverged:
            first = self.replica * self.tp_size  # world rank of TP rank 0 of this replica
            ranks = [first + r for r in diverged]
            raise ConsistencyError(
                f"cache state diverged at step {self._manager.counters.steps}: rank(s) "
                f"{', '.join(map(str, ranks))} differ from rank {first + ref} (the majority of "
                f"{tp.size}{' in replica ' + str(self.replica) if self.num_replicas > 1 else ''})",
                ranks)
        self._checks_passed += 1

    def state_digest(self) -> bytes:
        """xxh3-128 of the state that decides this cache's future behaviour (prefix index,
        tier occupancy, eviction order, sequences, and the remote tier's directory and
        fetches in flight): equal on ranks fed the same requests."""
        mine = self._manager.state_digest()
        return mine if self._remote is None else mine + self._remote.digest()

    # -- teardown --------------------------------------------------------------------------------
    def close(self, wait_for_peers: bool = True) -> None:
        """Free every tier (collective over the cache's communicator; idempotent). Each
        rank frees its own tiers first, then waits (bounded by the consensus timeout)
        until every rank has, so no rank's memory or disk file outlives close() anywhere."""
        if self._closed:
            return
        self._closed = True
        parts = self._parts
        # Every later call raises CacheClosedError; the manager reaches every pool
        # through the executor, so it must go too.
        self._manager = self._stager = self._parts = _CLOSED
        remote, self._remote = self._remote, None
        try:
            if remote is not None:
                parts.manager.host_observer = None
                remote.close()
            parts.teardown()
            # After a timed-out collective (or a stall anywhere in the process) the
            # communicator is unusable: nothing to wait on.
            if wait_for_peers and self._comm.usable:
                self._comm.barrier("close")
        finally:
            self._replicas.free()
            self._comm.free()

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # Leaving by an exception: peers may not be closing, do not wait for them.
        self.close(wait_for_peers=exc_type is None)

    def __repr__(self) -> str:
        return (f"KVCache(rank={self.rank}/{self.world_size}, tiers={self.tiers}, "
                f"device={self.device}, status={self.init_status.name})")


def create(cfg: CacheConfig | dict | str, comm=None) -> KVCache:
    """Build the cache on every rank of ``comm`` (collective; docs/design.md, "Start-up").
    ``comm=None`` uses a Dup of COMM_WORLD when MPI is running, else a single-rank job
    without MPI. Raises on every rank, with nothing left allocated, when the ranks agree
    to abort; the exception's ``init_seconds`` is then what the attempt cost (as in
    ``stats()``)."""
    return build(cfg, comm, None)


def build(cfg: CacheConfig | dict | str, comm, seams: Seams | None) -> KVCache:
    """``create`` with test seams (``kvdist.testing.create``)."""
    cfg = load_config(cfg)
    if cfg.cache.gpu == "external":
        raise ConfigError("cache.gpu", "external", "the engine owns the GPU tier: build the workers' side "
                          "with kvdist.external.create, the scheduler's with kvdist.external.ExternalPlanner")
    timing = InitTiming()
    with timing.clock("consensus"):
        c = dist_comm.resolve(comm, cfg.distributed.consensus_timeout_s)
    if seams is not None:
        seams.comm = c
    try:
        layout = ReplicaLayout.of(c.rank, c.size, cfg.distributed.tp_size)
        plan = None
        if remote_setup.wanted(cfg, layout):
            with timing.clock("consensus"):
                plan = remote_setup.plan_sharing(c, cfg, layout)
        builder = CandidateBuilder(cfg, c.rank, c.local_rank, c.local_size, seams,
                                   host_shared_path=plan.host_path if plan else None,
                                   events_replica=layout.replica if layout.tp_rank == 0 else None)
        done = establish(c, cfg, builder, timing)
    except BaseException as e:
        c.free()
        e.init_seconds = timing.as_dict()  # what the failed start cost this rank, for operators
        raise
    replicas = remote = None
    try:
        with timing.clock("consensus"):
            replicas = ReplicaComms(c, layout)
            step = cfg.distributed.step_timeout_s  # run-time collectives: the step deadline
            c.run_time(None if step == "auto" else step)
            replicas.tp.run_time(None if step == "auto" else step)
            if plan is not None:
                parts = done.candidate
                remote = remote_setup.commit_remote(
                    c, replicas, cfg, plan, done.status, parts.host, parts.gpu.raw,
                    parts.backend.executor, parts.device, ManagerSlots(parts.manager),
                    dict(enumerate(parts.manager.space.capacity)),
                    rules=seams.remote_rules if seams is not None else None)
                if remote is not None:
                    parts.manager.host_observer = remote.host
                    if seams is not None:
                        seams.remote = remote
    except BaseException:
        done.candidate.teardown()
        if replicas is not None:
            replicas.free()
        c.free()
        raise
    return KVCache(done.candidate, c, done.status, done, replicas, remote)
