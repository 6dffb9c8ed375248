"""The worker-side half of the connector (each vLLM worker process: one kvdist rank over
this worker's KV heads), over kvdist's ``ExternalCache``:

  register_kv_caches   kvdist's tiers built (the start-up consensus) and vLLM's tensors
                       registered;
  handshake            the tiers the ranks committed, for the scheduler's planner
                       (vLLM's handshake metadata: ``get_handshake_metadata``);
  handle_preemptions   before the forward: it waits for the saves still reading blocks
                       vLLM freed by preempting their request (``ExternalCache.fence``);
  start_load_kv        the step's loads issued in the planner's order (S4: after the
                       compute queued so far), the compute stream waiting for them
                       layer by layer;
  wait_for_layer_load  the layer's share of the loads waited for (S5 per layer);
  save_kv_layer        no copy; the last layer's call ends the forward's clock
                       (``ForwardClock``);
  wait_for_save        the step's saves (the blocks its forward completed) issued behind
                       the forward, which vLLM has queued by then (S4); nothing waits
                       for them: a finished request's blocks stay vLLM's held blocks
                       until ``get_finished`` names it;
  get_finished         held requests whose saves all landed, and asynchronous loads
                       whose copies all completed; the step's prefill figure for the
                       recompute policy;
  report               this rank's recompute-policy figures, for the planner;
  get_block_ids_with_load_errors  engine blocks whose bytes kvdist did not load.

Under vLLM's ``external_launcher`` (``agree``: every TP rank a process with its own
scheduler) what ``get_finished``, ``load_errors`` and ``report`` give is agreed across
the ranks each step (``agree``: one collective over kvdist's communicator), so every
rank's scheduler takes the decisions vLLM's one scheduler would; that needs the ranks
to be kvdist ranks of one job (``mpiexec``): a worker whose kvdist job is itself alone
while vLLM's TP group is larger (``torchrun`` without MPI) stops at
``register_kv_caches`` with one line.

Invariants: the asynchronous loads named in ``_async`` are exactly those in flight whose
completion vLLM waits for in ``finished_recving``; a synchronous load is never reported
there (vLLM accepts only requests that wait for it). Every asynchronous load has copies or
failed blocks to report, so ``finished`` names it: vLLM asks ``get_num_new_matched_tokens``
and ``update_state_after_alloc`` in one scheduling pass, in which the planner loses no
block. ``_held`` are the requests vLLM holds for their saves (the metadata's ``held``) not
yet reported: only those may be named in ``finished_sending`` (vLLM frees their blocks)."""

from __future__ import annotations

__all__ = ["WorkerSide"]

from collections.abc import Mapping
from dataclasses import replace

import torch

from ...config import CacheConfig
from ...errors import ConfigError
from ...external import ExternalCache, create
from . import local_worker
from .agree import Agreement, Report
from .forward_clock import ForwardClock
from .plan import KVDistConnectorMetadata, KVDistHandshake, KVDistWorkerMetadata


class WorkerSide:
    def __init__(self, cfg: CacheConfig, agree: bool = False, tp: int = 1) -> None:
        """``agree``: every TP rank runs its own scheduler (vLLM's external_launcher,
        ``tp`` ranks): reports are agreed across the ranks (module docstring)."""
        self.cfg = cfg
        self.agree, self.tp = agree, tp
        self._agreement: Agreement | None = None
        self._agreed: Report | None = None  # this step's agreed report (get_finished)
        self._cache: ExternalCache | None = None
        self._layer: dict[str, int] = {}
        self._async: set[str] = set()
        self._held: set[str] = set()
        self._clock: ForwardClock | None = None

    @property
    def cache(self) -> ExternalCache:
        assert self._cache is not None, "the worker's KV caches are not registered (register_kv_caches)"
        return self._cache

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor], comm=None) -> None:
        """Build this rank's tiers (collective over ``comm``: None is a Dup of
        COMM_WORLD under mpiexec, else this worker alone) and register vLLM's tensors."""
        assert self._cache is None, "register_kv_caches called twice"
        device = next(iter(kv_caches.values())).device
        cache = create(self.cfg, comm=comm, device=device)
        try:
            if self.agree and self.tp > 1 and cache.tp_size == 1:
                raise ConfigError("parallel_config.tensor_parallel_size", self.tp,
                                  "under external_launcher every TP worker must be a rank of one kvdist job, "
                                  "but this worker's is alone: start the workers with mpiexec (not torchrun "
                                  "alone) and call kvdist.integrations.vllm.launcher_env() before LLM(...)")
            if self.agree and cache.tp_size not in (1, self.tp):
                raise ConfigError("distributed.tp_size", self.cfg.distributed.tp_size,
                                  f"kvdist's replicas have {cache.tp_size} ranks but vLLM's "
                                  f"tensor_parallel_size is {self.tp}: set distributed.tp_size: {self.tp}")
            cache.register(kv_caches)
        except BaseException:
            cache.close(wait_for_peers=False)
            raise
        if self.agree and cache.tp_size > 1:
            self._agreement = Agreement(cache.tp_size)
        self._cache = cache
        local_worker.offer(cache.peers)
        self._layer = {name: i for i, name in enumerate(kv_caches)}
        self._clock = ForwardClock(device)

    def handshake(self) -> KVDistHandshake:
        return KVDistHandshake(self.cache.tier_plan, self.cache.init_status.name)

    def handle_preemptions(self, meta: KVDistConnectorMetadata) -> None:
        if meta.preempted:
            self.cache.fence(meta.preempted)

    def start_load_kv(self, meta: KVDistConnectorMetadata) -> None:
        self.cache.start(meta.transfers)
        self._async |= meta.async_loads
        self._held |= meta.held

    def wait_for_save(self, meta: KVDistConnectorMetadata) -> None:
        if len(meta.saves):
            self.cache.save(meta.saves)

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer.get(layer_name)
        if layer is None:  # a layer kvdist does not hold (not one of the registered)
            return
        self.cache.wait_layer(layer)
        if layer == 0:  # after the wait: the forward's clock leaves out layer 0's load
            self._clock.start()

    def save_kv_layer(self, layer_name: str) -> None:
        if self._layer.get(layer_name) == len(self._layer) - 1:
            self._clock.stop()

    def get_finished(self, meta: KVDistConnectorMetadata) -> tuple[set[str], set[str]]:
        """After the step's forward: what finished, and the forward's figure."""
        for tokens, seconds in self._clock.end_step(meta.computed_tokens):
            self.cache.observe_prefill(tokens, seconds)
        self.cache.end_step()  # the remote tier's step agreement (TP group), when it is on
        done = self.cache.finished()
        loaded = self._async & done.loaded
        self._async -= loaded
        saved = self._held - self.cache.saving()
        self._held -= saved
        if self._agreement is None:
            return saved, loaded
        mine = Report(frozenset(saved), frozenset(loaded), frozenset(self.cache.failed_blocks()),
                      tuple(self.cache.figures()))
        agreed = self._agreed = self._agreement.step(self.cache.allgather(mine, "the workers' step report"))
        return set(agreed.saved), set(agreed.loaded)

    def load_errors(self) -> set[int]:
        if self._agreement is None:
            return self.cache.failed_blocks()
        agreed = self._agreed
        if agreed is None:
            return set()
        self._agreed = replace(agreed, failed=frozenset())  # named once; report() reads the figures
        return set(agreed.failed)

    def report(self) -> KVDistWorkerMetadata:
        if self._agreement is not None and self._agreed is not None:
            return KVDistWorkerMetadata(self._agreed.figures)
        return KVDistWorkerMetadata(tuple(self.cache.figures()))

    def shutdown(self) -> None:
        """Wait for every copy (a save's blocks are vLLM's again after this) and free
        kvdist's tiers."""
        if self._cache is not None:
            cache, self._cache = self._cache, None
            local_worker.withdraw(cache.peers)
            cache.close()
