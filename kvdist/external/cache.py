"""A worker rank's side of ``cache.gpu: external``: kvdist's host and disk tiers (built
by the start-up consensus, ``kvdist.external.create``), the engine's KV tensors once it
registers them, and the transfer engine that issues the planner's copies between them.

Per engine step (docs/design.md, "An engine-owned GPU tier"):

* ``start(transfers)``, before the forward pass: the planner's copies, issued in their
  order through the transfer engine (rules S1, S2 on the engine's block ids, which are
  the GPU tier's slots); every copy touching an engine block first waits for the
  compute stream's work queued so far (S4: a save reads a block the last forward pass
  wrote; a load overwrites a block whose last reader may still run). Then the compute
  stream is made to wait for the loads alone, layer by layer (S5); saves run behind
  the forward pass.
* ``wait_layer(layer)``, before attention reads ``layer``: S5 for that layer's group.
* ``save(transfers)``, once the forward pass is queued: copies out of the blocks it
  computed, after the compute stream's work so far (S4); nothing waits for them.
* ``end_step()``, at the end of every step on every rank of the replica, with the
  remote tier on (``peers``, ``kvdist.external.peers``): the TP group agrees on the
  directory and on the fetches every rank resolved; the good blocks of a decided fetch
  are copied into the engine's blocks, the others become ``failed_blocks`` (R1, R2).
* ``finished()``: the requests whose loads or saves have completed since the last call;
  ``saving()`` those with saves still in flight; ``failed_blocks()``: engine block ids
  whose loads failed (the engine recomputes them); ``fence(requests)`` when the engine
  freed blocks a save may still read (the compute stream waits for those saves).

Who holds what: while a request's load is in flight, its engine blocks belong to the
transfer: the engine must neither free, reuse nor read them. While a save is in flight
the engine may read its blocks but must neither free nor write them (a finished
request's blocks are held until ``finished`` names it; a preempted one's are fenced).
kvdist's own slots need no holding: their
reuse is ordered after every copy reading them (S2)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .. import faults
from ..backend import simulate_async
from ..blocks import HOST, SlotSpace
from ..config import CacheConfig
from ..distributed.consensus import Committed, InitStatus
from ..distributed.replicas import ReplicaComms
from ..errors import CacheClosedError, KVDistError
from ..layout import KVLayout
from ..manager import DEMOTE_BATCH_BYTES
from ..recompute_policy import RecomputePolicy
from ..seams import Seams
from ..storage import DiskPool, HostPool
from ..transfer import DEMOTE, RELOAD, SPILL, Executor, SimExecutor, SyncExecutor, TransferEngine
from ..transfer.bounce import bounce_blocks
from .copies import ExternalCopies
from .peers import PeerTier
from .plan import LOAD, SAVE, TierPlan, Transfers
from .submit import SUBMIT_BYTES, submission
from .tier import ExternalGpuTier

__all__ = ["ExternalCache", "ExternalTiers", "Finished"]


def _on_cuda(gpu: ExternalGpuTier) -> bool:
    """Whether the engine's tensors take the CUDA executor (the CPU tests of that
    executor, with stand-in streams, say yes for CPU tensors)."""
    return gpu.device.type == "cuda"


@dataclass(slots=True)
class ExternalTiers:
    """The tiers one rank built at start-up (a consensus candidate until committed)."""

    host: HostPool | None = None
    disk: DiskPool | None = None

    def teardown(self) -> None:
        for pool in (self.disk, self.host):
            if pool is not None:
                pool.close()
        self.disk = self.host = None


@dataclass(frozen=True, slots=True)
class Finished:
    """Requests whose copies have all completed since the last ``finished()``."""

    saved: frozenset
    loaded: frozenset


class ExternalCache:
    """One worker rank's tiers and copies (see the module docstring)."""

    def __init__(self, cfg: CacheConfig, tiers: ExternalTiers, comm, device: torch.device,
                 init: Committed, seams: Seams | None = None, replicas: ReplicaComms | None = None,
                 peers: PeerTier | None = None):
        self.config = cfg
        self.layout = KVLayout.from_config(cfg)
        self.device = device
        self.rank: int = comm.rank
        self.world_size: int = comm.size
        self.init_status: InitStatus = init.status
        self.tier_plan = TierPlan(init.capacity[1], init.capacity[2])
        self.tiers: tuple[str, ...] = tuple(
            n for n, c in (("host", init.capacity[1]), ("disk", init.capacity[2])) if c)
        self._comm = comm
        self._replicas = replicas  # the TP group (and cross-replica communicator) of distributed.tp_size
        self._group = replicas.tp if replicas is not None else comm  # this replica's ranks
        self.peers = peers  # the remote tier (None: off); the planner's PeerLookup
        self._fetching: dict[Hashable, int] = {}  # request -> its fetches not decided yet
        self._parts = tiers
        self._seams = seams or Seams()
        self._gpu: ExternalGpuTier | None = None
        self._engine: TransferEngine | None = None
        self._executor: Executor | None = None
        self._inflight: dict[tuple[str, Hashable], list] = {}  # (kind, request) -> events
        self._failed: set[int] = set()
        self._policy = RecomputePolicy(self.layout.bytes_per_block, self.layout.tokens_per_block)
        self._moved: dict[str, int] = {}  # blocks copied, by route
        self._closed = False

    # -- the engine's tensors ------------------------------------------------------------------
    def register(self, kv_caches: Mapping[str, torch.Tensor] | Sequence[torch.Tensor], *,
                 kv_dim: int = 0, gather: str = "auto") -> None:
        """The engine's paged KV tensors, one per layer in layer order (a mapping keeps
        its order: vLLM's ``{layer_name: tensor}``): vLLM 0.33's ``[num_blocks, heads,
        block_size, 2 * head_size]`` views, or ``[2, num_blocks, block_size, heads,
        head_size]`` (``kv_dim=1``: ``[num_blocks, 2, ...]``); see ``kvdist.external.tier``.
        ``gather``: how CUDA copies move a block's pieces (``kvdist.external.cuda``).
        Raises ConfigError naming the layer whose tensor does not match the config."""
        self._live()
        assert self._gpu is None, "the engine's KV tensors are registered once"
        names = list(kv_caches) if isinstance(kv_caches, Mapping) else None
        tensors = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)
        gpu = ExternalGpuTier(self.layout, tensors, names, kv_dim=kv_dim)
        host, disk = self._parts.host, self._parts.disk
        groups = self.layout.layer_groups(self.layout.groups_for(self.config.cache.layer_groups,
                                                                 self.config.cache.min_copy_piece))
        seams = self._seams
        if _on_cuda(gpu):
            from .cuda import ExternalCudaExecutor

            executor: Executor = ExternalCudaExecutor(
                gpu, host, disk, gpu.device, path=seams.copy_path, log=seams.batch_log, groups=groups,
                gather=gather, on_failed=self._failed.update)
        elif simulate_async(self.config):
            executor = SimExecutor(ExternalCopies(gpu, host, disk, self._failed.update), log=seams.batch_log,
                                   groups=groups)
        else:
            executor = SyncExecutor(ExternalCopies(gpu, host, disk, self._failed.update), log=seams.batch_log)
        bpb = self.layout.bytes_per_block
        limits = {DEMOTE: max(1, DEMOTE_BATCH_BYTES // bpb), RELOAD: bounce_blocks(bpb),
                  SPILL: bounce_blocks(bpb)}
        space = SlotSpace((gpu.num_blocks, self.tier_plan.host_blocks, self.tier_plan.disk_blocks))
        self._engine = TransferEngine(space, executor, seams=seams.engine_seams(), block_id=lambda s: s,
                                      batch_limits=limits)
        self._gpu, self._executor = gpu, executor
        if self.peers is not None:
            host = space.base[HOST]
            self.peers.watch(lambda local: self._engine.writes_pending(local + host))

    @property
    def num_engine_blocks(self) -> int:
        return self._registered().num_blocks

    @property
    def executor(self) -> Executor:
        """The copy executor (tests hold its simulated streams; the GPU probe reads its figures)."""
        self._registered()
        return self._executor

    # -- one engine step --------------------------------------------------------------------------
    def start(self, transfers: Transfers) -> None:
        """Issue the planner's copies in their order (see the module docstring); the
        compute stream then waits for the loads among them, layer by layer."""
        loads = self._issue(transfers)
        if "S5" in self._engine.rules:
            self._executor.compute_wait(loads, layered=self._executor.layered)

    def save(self, transfers: Transfers) -> None:
        """Issue copies out of blocks the forward pass just computed, once its work is
        queued (the end of the engine's step): each waits for the compute stream's
        work so far (S4), none is waited for by the compute stream or the host (they
        run behind the next steps; ``finished`` reports them). Loads among them are
        not waited for either: give loads to ``start``."""
        self._issue(transfers)

    def _issue(self, transfers: Transfers) -> list:
        """Issue ``transfers`` in their order, after the compute stream's work so far
        for every engine block they touch (S4); the events of their loads."""
        gpu = self._registered()
        t, mine = transfers.tiers, self.tier_plan
        if t.host_blocks > mine.host_blocks or t.disk_blocks > mine.disk_blocks:
            raise KVDistError(f"the planner numbers slots for {t}, but this rank committed {mine}: build "
                              f"ExternalPlanner with the workers' tier_plan (ExternalPlanner.adopt)")
        engine = self._engine
        base = engine.space.base
        routes = transfers.routes()
        src = transfers.src + np.array([base[r.src] for r in routes], dtype=np.int64)
        dst = transfers.dst + np.array([base[r.dst] for r in routes], dtype=np.int64)
        dropped = self._drill(transfers)
        if self.peers is not None:
            for slot, h in transfers.filled:  # R2: stamps odd before the copies into them are issued
                self.peers.filled(slot, h)
        else:
            assert not transfers.fetches, "fetches from other replicas, but this rank has no remote tier"
        touched = np.concatenate((src[src < base[1]], dst[dst < base[1]]))
        assert (touched < gpu.num_blocks).all(), "an engine block id beyond the registered tensors"
        engine.compute_uses(touched)  # S4: copies of these blocks follow the compute stream so far
        engine.begin_step()
        job, moved = transfers.job, self._moved
        keep = ~np.isin(job, list(dropped)) if dropped else np.ones(len(job), dtype=bool)
        rid = np.where(keep, transfers.route.astype(np.int64), -1)
        # Batches of SUBMIT_BYTES, loads first and in turns with saves (kvdist.external.submit)
        for batch in submission(routes, rid, src, dst, self.layout.bytes_per_block, SUBMIT_BYTES):
            for route, s, d in batch:
                engine.copy_many(route, s, d)
                moved[route.name] = moved.get(route.name, 0) + len(s)
            engine.flush()
        loads = []
        for j, jb in enumerate(transfers.jobs):
            if j in dropped:
                continue
            mine = job == j
            events = engine.pending_events(np.concatenate((src[mine], dst[mine])))
            # Every job is reported by finished(), one with nothing to copy at once (a load
            # whose blocks all failed: the engine must not wait for it forever).
            self._inflight.setdefault((jb.kind, jb.request_id), []).extend(events)
            if jb.kind == LOAD:
                self._failed.update(jb.failed)
                loads.extend(events)
        for f in transfers.fetches:  # blocks of other replicas: decided at a later end_step
            if f.job in dropped:
                continue
            rid = transfers.jobs[f.job].request_id
            self.peers.fetch(rid, f)
            self._fetching[rid] = self._fetching.get(rid, 0) + 1
        return loads

    def _drill(self, transfers: Transfers) -> set[int]:
        """Fault drill ``external_load@rank``: this rank's loads fail (not issued; their
        blocks reported failed)."""
        if not faults.active("external_load", self.rank):
            return set()
        out = set()
        for j, jb in enumerate(transfers.jobs):
            if jb.kind == LOAD and jb.blocks:
                out.add(j)
                self._failed.update(jb.blocks + jb.failed)
                self._inflight.setdefault((LOAD, jb.request_id), [])
        return out

    def wait_layer(self, layer: int) -> None:
        """Before attention reads ``layer``: the compute stream waits for the copies of
        that layer's group of the loads ``start`` issued (S5 per layer)."""
        self._registered()
        if not 0 <= layer < self.layout.num_layers:
            raise IndexError(f"layer {layer} outside 0..{self.layout.num_layers - 1}")
        if self._executor.layered and "S5" in self._engine.rules:
            self._executor.wait_layer(layer)

    def end_step(self) -> None:
        """Every rank of the replica at the end of every engine step, with the remote
        tier on (collective inside the TP group; nothing otherwise): the holder's host
        tier published, the directory prefix and the fetches the group resolved agreed
        (``PeerTier.end_step``); each decided fetch's good blocks copied into the
        engine's blocks, the others failed (``failed_blocks``)."""
        self._registered()
        peers = self.peers
        if peers is None:
            return
        peers.end_step()
        for fx in peers.decided():
            if len(fx.blocks):
                self._write_engine(fx.rows, fx.blocks)
            peers.release(fx.rows)
            self._failed.update(fx.failed)
            left = self._fetching[fx.request_id] - 1
            if left:
                self._fetching[fx.request_id] = left
            else:
                del self._fetching[fx.request_id]

    def _write_engine(self, rows: np.ndarray, blocks: np.ndarray) -> None:
        """Engine blocks ``blocks`` <- landing ``rows`` (whole blocks, every layer), after
        the copies the transfer engine still has on those blocks (S2), on the engine's
        current stream (after the compute queued so far, S4)."""
        gpu, engine = self._gpu, self._engine
        self._executor.wait_host(engine.pending_events(blocks))
        src = self.peers.landing[torch.from_numpy(rows)].to(gpu.device)
        gpu.scatter(src, torch.from_numpy(blocks).to(gpu.device), range(self.layout.num_layers))
        if gpu.device.type == "cuda":
            torch.cuda.current_stream(gpu.device).synchronize()  # the rows are reused next
        self._moved["remote"] = self._moved.get("remote", 0) + len(blocks)

    def finished(self) -> Finished:
        """The requests whose loads (``loaded``) or saves (``saved``) have all completed
        since the last call; their engine blocks are the engine's again. A load with
        blocks fetched from other replicas completes at the ``end_step`` that decides
        them."""
        self._registered()
        done = self._executor.is_done
        out: dict[str, set] = {LOAD: set(), SAVE: set()}
        fetching = self._fetching
        for key in [k for k, evs in self._inflight.items()
                    if all(done(e) for e in evs) and not (k[0] == LOAD and k[1] in fetching)]:
            del self._inflight[key]
            out[key[0]].add(key[1])
        return Finished(frozenset(out[SAVE]), frozenset(out[LOAD]))

    def saving(self) -> set:
        """The requests with saves still in flight (as of the last ``finished``)."""
        return {r for kind, r in self._inflight if kind == SAVE}

    def fence(self, request_ids) -> None:
        """The engine freed these requests' blocks (a preemption) and may write them in
        its next forward pass: the compute stream waits for their saves still in flight
        (S5 for the blocks a save reads; a load into them is ordered by S2)."""
        self._registered()
        events = [e for r in request_ids for e in self._inflight.get((SAVE, r), ())]
        if events and "S5" in self._engine.rules:
            self._executor.compute_wait(events)

    def failed_blocks(self) -> set[int]:
        """Engine block ids whose loads failed since the last call (recompute them)."""
        out = set(self._failed)
        self._failed.clear()  # the set itself stays: the CPU copies add failed disk reads to it
        return out

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed ``tokens`` prompt tokens in ``seconds``: the recompute side
        of the planner's onboard-or-recompute decision (``figures``)."""
        self._policy.observe_prefill(tokens, seconds)

    def figures(self) -> list[int]:
        """This rank's running means of the load bandwidth from each tier (the copies
        the executor timed) and of the prefill rate (``observe_prefill``), for the
        planner's recompute policy: ``ExternalPlanner.agree`` takes their MIN over the
        TP ranks (``RecomputePolicy.FIGURES`` order)."""
        for route, nbytes, seconds in self.executor.take_timings():
            self._policy.observe_copy(route.src, nbytes, seconds)
        return self._policy.local_figures()

    def allgather(self, obj: object, what: str) -> list:
        """Every worker rank's ``obj`` (picklable), in rank order: collective over the
        workers' communicator, bounded by ``distributed.step_timeout_s`` (an engine whose
        every worker runs its own scheduler agrees on what they report: vLLM's
        ``external_launcher``, ``kvdist.integrations.vllm.agree``)."""
        self._live()
        return self._group.allgather(obj, what)

    @property
    def tp_size(self) -> int:
        """Ranks of this replica (``distributed.tp_size``; the whole job when 0)."""
        return self._group.size

    def synchronize(self) -> None:
        """The host waits until every issued copy has run."""
        if self._engine is not None:
            self._engine.synchronize()

    def stats(self) -> dict:
        e = self._engine
        return {"tiers": list(self.tiers), "init_status": self.init_status.name,
                "tier_plan": {"host_blocks": self.tier_plan.host_blocks,
                              "disk_blocks": self.tier_plan.disk_blocks},
                "engine_blocks": self._gpu.num_blocks if self._gpu is not None else 0,
                "in_flight": len(self._inflight), "blocks_moved": dict(self._moved),
                "block_bytes": self.layout.bytes_per_block,
                "transfer_batches": e.stats.batches if e is not None else 0,
                "transfer": self._executor.stats() if self._executor is not None else {},
                "rank": self.rank, "world_size": self.world_size,
                **({"remote": self.peers.stats()} if self.peers is not None else {})}

    def check_invariants(self) -> None:
        if self._engine is not None:
            self._engine.check_invariants()
        if self.peers is not None:
            self.peers.check_invariants()

    # -- teardown ------------------------------------------------------------------------------------
    def close(self, wait_for_peers: bool = True) -> None:
        """Wait for every copy, free kvdist's tiers (the engine's tensors stay the
        engine's); collective over the workers' communicator, like ``create``."""
        if self._closed:
            return
        self._closed = True
        try:
            self.synchronize()
            if self._executor is not None:
                self._executor.close()
            if self.peers is not None:
                self.peers.close()
            if self._gpu is not None:
                self._gpu.close()
            self._parts.teardown()
            if wait_for_peers and self._comm.usable:
                self._comm.barrier("close")
        finally:
            if self._replicas is not None:
                self._replicas.free()
            self._comm.free()

    def __enter__(self) -> ExternalCache:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(wait_for_peers=exc_type is None)

    def _live(self) -> None:
        if self._closed:
            raise CacheClosedError("the cache is closed: close() freed its tiers; create a new one")

    def _registered(self) -> ExternalGpuTier:
        self._live()
        if self._gpu is None:
            raise KVDistError("register the engine's KV tensors first (ExternalCache.register)")
        return self._gpu

