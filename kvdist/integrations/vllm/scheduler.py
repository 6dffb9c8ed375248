"""The scheduler-side half of the connector (vLLM's scheduler process), over kvdist's
``ExternalPlanner``: how many tokens beyond vLLM's own GPU hit kvdist holds, loads
planned into the block ids vLLM allocated, saves planned when a request finishes, the
plan shipped to the workers each step. No tensors, no MPI: the planner decides for every
worker (rule R1 by construction) and the workers replay its copies in order.

State, keyed by vLLM request id: ``_hits`` the block vLLM's own hit ends at, remembered
by ``get_num_new_matched_tokens`` until ``update_state_after_alloc``; ``_async`` the
asynchronous loads of the step being scheduled; ``_saving`` the requests whose blocks vLLM
keeps for a save in flight (until the workers report them in ``finished_sending``):
``saving()``.

Blocks are named by vLLM's own block hashes (``request.block_hashes``, chained, covering
the LoRA adapter, the cache salt and multimodal inputs: ``ExternalPlanner.prompt_of_keys``),
so kvdist reuses exactly what vLLM's own prefix cache would."""

from __future__ import annotations

__all__ = ["SchedulerSide"]

from typing import TYPE_CHECKING, Any

from ...external import ExternalPlanner, Prompt
from .plan import KVDistConnectorMetadata, KVDistWorkerMetadata

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class SchedulerSide:
    def __init__(self, planner: ExternalPlanner, load_async: bool) -> None:
        self.planner = planner
        self.block_size = planner.tpb
        self.load_async = load_async
        self._hits: dict[str, int] = {}
        self._async: set[str] = set()
        self._saving: set[str] = set()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens kvdist holds right after vLLM's block-aligned hit (never the whole
        prompt); ``(n, True)`` when loads are asynchronous. Changes nothing in kvdist."""
        n = self.planner.lookup(self._prompt(request), num_computed_tokens)
        if n == 0:
            return 0, False
        self._hits[request.request_id] = num_computed_tokens
        return n, self.load_async

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
        self.planner.plan_load(request.request_id, self._prompt(request), engine_blocks, hit)
        if self.load_async:
            self._async.add(request.request_id)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Plan the save of the request's full computed blocks that kvdist lacks. True
        (vLLM keeps the blocks until the workers report the save finished) exactly when
        a copy out of them was planned."""
        self._hits.pop(request.request_id, None)
        n = min(request.num_computed_tokens // self.block_size, len(block_ids), len(request.block_hashes))
        computed = self.planner.prompt_of_keys(request.block_hashes[:n], n * self.block_size)
        if n == 0 or self.planner.saveable(computed) == 0:
            return False, None
        plan = self.planner.plan_save(request.request_id, computed, block_ids[:n])
        if not plan.blocks:
            return False, None
        self._saving.add(request.request_id)
        return True, None

    def _prompt(self, request: Request) -> Prompt:
        return self.planner.prompt_of_keys(request.block_hashes, request.num_tokens)

    def build_connector_meta(self, computed_tokens: int) -> KVDistConnectorMetadata:
        """The step's plan; ``computed_tokens``: what its forward computes."""
        meta = KVDistConnectorMetadata(self.planner.take(), frozenset(self._async), computed_tokens)
        self._async.clear()
        return meta

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
