"""The scheduler-side half of the connector (vLLM's scheduler process), over kvdist's
``ExternalPlanner``: how many tokens beyond vLLM's own GPU hit kvdist holds, loads
planned into the block ids vLLM allocated, saves planned as the forward computes each
block, the plan shipped to the workers each step. No tensors, no MPI: the planner
decides for every worker (rule R1 by construction) and the workers replay its copies in
order.

Saves are eager: each step's metadata carries the saves of the full blocks that step's
forward completes (``build_connector_meta``), which the workers issue at
``wait_for_save``, behind the forward. A request that finishes with any save planned is
held (``request_finished`` returns True) until every worker reports its saves landed
(``finished_sending``); one preempted with saves planned is named to the workers, whose
next forward waits for those saves before it may write the freed blocks.

State, keyed by vLLM request id: ``_requests`` the live requests (``on_new_request`` to
``request_finished``); ``_blocks`` their engine block ids and ``_upto`` how many of their
blocks were offered for saving, as the scheduler's outputs give them (``_loaded``: the
blocks a load fills, never saved from the engine); ``_saved`` those
with a save planned since they were last (re)scheduled from scratch; ``_hits`` the block
vLLM's own hit ends at, remembered by ``get_num_new_matched_tokens`` until
``update_state_after_alloc``; ``_async`` the asynchronous loads of the step being
scheduled; ``_held`` / ``_preempted`` the requests to name in the next metadata;
``_saving`` the requests whose blocks vLLM keeps for a save in flight (until the
workers report them in ``finished_sending``): ``saving()``.

Blocks are named by vLLM's own block hashes (``request.block_hashes``, chained, covering
the LoRA adapter, the cache salt and multimodal inputs: ``ExternalPlanner.prompt_of_keys``),
so kvdist reuses exactly what vLLM's own prefix cache would."""

from __future__ import annotations

__all__ = ["SchedulerSide"]

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ...errors import ConfigError
from ...external import ExternalPlanner, Prompt, TierPlan
from . import local_worker
from .plan import KVDistConnectorMetadata, KVDistHandshake, KVDistWorkerMetadata

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class SchedulerSide:
    def __init__(self, planner: ExternalPlanner, load_async: bool, remote: bool = False) -> None:
        """``remote``: ``distributed.remote.enabled`` (the planner then asks the remote
        tier of the worker in this process: ``adopt``)."""
        self.planner = planner
        self.remote = remote
        self.block_size = planner.tpb
        self.load_async = load_async
        self._requests: dict[str, Request] = {}
        self._blocks: dict[str, list[int]] = {}
        self._upto: dict[str, int] = {}
        self._saved: set[str] = set()
        self._hits: dict[str, int] = {}
        self._loaded: dict[str, int] = {}
        self._async: set[str] = set()
        self._held: set[str] = set()
        self._preempted: set[str] = set()
        self._saving: set[str] = set()

    def adopt(self, workers: Mapping[int, KVDistHandshake]) -> None:
        """The tiers every worker committed at start-up (vLLM's handshake metadata, by
        TP rank): the planner numbers its slots in the tiers all of them have."""
        plans = [m.tiers for m in workers.values()]
        if plans:
            self.planner.adopt(TierPlan(min(p.host_blocks for p in plans), min(p.disk_blocks for p in plans)))
        if self.remote:
            here, peers = local_worker.take()
            if not here:
                raise ConfigError("distributed.remote.enabled", True,
                                  "needs each TP worker's process to run its own scheduler (vLLM's "
                                  "distributed_executor_backend='external_launcher' under mpiexec): "
                                  "this scheduler has no worker beside it")
            self.planner.peers = peers  # None: the remote tier is off (one replica, or it failed)

    def on_new_request(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens kvdist holds right after vLLM's block-aligned hit (never the whole
        prompt), in this replica's tiers or other replicas' (the remote tier);
        ``(n, True)`` when loads are asynchronous, as a load with blocks of other
        replicas always is (they land at a later step boundary). Changes nothing in
        kvdist."""
        here, remote = self.planner.lookup_split(self._prompt(request), num_computed_tokens)
        if here + remote == 0:
            return 0, False
        self._hits[request.request_id] = num_computed_tokens
        return here + remote, self.load_async or remote > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Plan the load of the promised blocks into the engine blocks vLLM allocated for
        them: the request's blocks right after vLLM's own hit. Blocks kvdist lost since
        the lookup go to the workers as failed (vLLM recomputes them)."""
        if num_external_tokens == 0:
            return
        hit = self._hits.pop(request.request_id)
        first, n = hit // self.block_size, num_external_tokens // self.block_size
        assert n * self.block_size == num_external_tokens, \
            f"{num_external_tokens} tokens are not whole blocks"
        engine_blocks = blocks.get_block_ids()[0][first:first + n]
        plan = self.planner.plan_load(request.request_id, self._prompt(request), engine_blocks, hit)
        self._loaded[request.request_id] = first + n  # loaded (or failed, then recomputed): not saved
        if self.load_async or plan.remote:
            self._async.add(request.request_id)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """True (vLLM keeps the blocks until the workers report the saves finished)
        exactly when a save out of the request's blocks was planned: its last ones may
        still be in flight. Full computed blocks not offered yet (their hashes came after
        their step: asynchronous scheduling) are planned now, for the next step."""
        rid = request.request_id
        self._plan_saves(rid, 0)
        self._hits.pop(rid, None)
        self._loaded.pop(rid, None)
        self._requests.pop(rid, None)
        self._blocks.pop(rid, None)
        self._upto.pop(rid, None)
        self._preempted.discard(rid)
        if rid not in self._saved:
            return False, None
        self._saved.discard(rid)
        self._held.add(rid)
        self._saving.add(rid)
        return True, None

    def _prompt(self, request: Request) -> Prompt:
        return self.planner.prompt_of_keys(request.block_hashes, request.num_tokens)

    def build_connector_meta(self, out: SchedulerOutput) -> KVDistConnectorMetadata:
        """The step's plan: the loads planned while scheduling it, then the saves of the
        full blocks its forward completes (issued behind the forward)."""
        loads = self.planner.take()
        for rid in out.preempted_req_ids or ():
            self._blocks.pop(rid, None)
            self._upto.pop(rid, None)
            if rid in self._saved:  # its blocks are free: the forward waits for its saves
                self._preempted.add(rid)
                self._saved.discard(rid)
        for new in out.scheduled_new_reqs:
            self._blocks[new.req_id] = list(new.block_ids[0])
            self._upto[new.req_id] = self._loaded.pop(new.req_id, 0)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                self._blocks[rid], self._upto[rid] = list(ids[0]) if ids else [], 0
            elif ids:
                self._blocks.setdefault(rid, []).extend(ids[0])
        for rid, n in out.num_scheduled_tokens.items():
            self._plan_saves(rid, n - len(out.scheduled_spec_decode_tokens.get(rid, ())))
        meta = KVDistConnectorMetadata(loads, self.planner.take(), frozenset(self._async),
                                       frozenset(self._held), frozenset(self._preempted),
                                       out.total_num_scheduled_tokens)
        self._async.clear()
        self._held.clear()
        self._preempted.clear()
        return meta

    def _plan_saves(self, rid: str, computed: int) -> None:
        """Saves of request ``rid``'s blocks that are full once the forward has computed
        ``computed`` more tokens (draft tokens left out: they may be rejected)."""
        request, blocks = self._requests.get(rid), self._blocks.get(rid)
        if request is None or blocks is None:
            return
        full = min((request.num_computed_tokens + computed) // self.block_size, len(request.block_hashes),
                   len(blocks))
        first = self._upto.get(rid, 0)
        if full <= first:
            return
        self._upto[rid] = full
        keys = self.planner.prompt_of_keys(request.block_hashes[:full], full * self.block_size)
        if self.planner.saveable(keys, first) == 0:
            return
        if self.planner.plan_save(rid, keys, blocks[first:full], first).blocks:
            self._saved.add(rid)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The workers' report of a step: saves finished, and their figures (MIN over the
        workers), from which the planner's lookups cut where loading stops paying."""
        self._saving.difference_update(output.finished_sending or ())
        meta = output.kv_connector_worker_meta
        if meta is not None:
            assert isinstance(meta, KVDistWorkerMetadata), f"unexpected worker metadata {type(meta).__name__}"
            self.planner.agree(list(meta.figures))

    def saving(self) -> set[str]:
        """The requests whose blocks vLLM keeps for a save in flight."""
        return set(self._saving)
