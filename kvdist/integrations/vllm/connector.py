"""``KVDistConnector``: vLLM's v1 KV connector API (vllm==0.33.0) over kvdist. vLLM
builds one in its scheduler process (role SCHEDULER: ``scheduler.SchedulerSide`` over
kvdist's planner) and one in every worker (role WORKER: ``worker.WorkerSide`` over a
kvdist rank holding that worker's KV heads); this class only routes vLLM's calls to the
half of its role. Turn it on with

    KVTransferConfig(kv_connector="KVDistConnector",
                     kv_connector_module_path="kvdist.integrations.vllm",
                     kv_role="kv_both",
                     kv_connector_extra_config={"kvdist_config": "kvdist.yaml"})

Extra config keys: ``kvdist_config`` (the kvdist YAML: tiers, sizes, policies; the KV
geometry and block size come from vLLM: ``settings``), ``load_async`` (false: a hit
loads under the step's forward, waited for layer by layer; true: the request waits a
step while its blocks load)."""

from __future__ import annotations

__all__ = ["KVDistConnector"]

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.core.sched.output import SchedulerOutput

from ...errors import ConfigError
from ...external import ExternalCache, ExternalPlanner
from .plan import KVDistConnectorMetadata, KVDistHandshake
from .scheduler import SchedulerSide
from .settings import kvdist_config, layout_of
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

EXTRA_KEYS = ("kvdist_config", "load_async")


class KVDistConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        for key in extra:
            if key not in EXTRA_KEYS:
                raise ConfigError(f"kv_connector_extra_config.{key}", extra[key],
                                  f"unknown key (known: {', '.join(EXTRA_KEYS)})")
        load_async = extra.get("load_async", False)
        if not isinstance(load_async, bool):
            raise ConfigError("kv_connector_extra_config.load_async", load_async, "must be true or false")
        cfg = kvdist_config(extra.get("kvdist_config"), layout_of(kv_cache_config))
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(ExternalPlanner(cfg), load_async, cfg.distributed.remote.enabled)
        else:
            parallel = vllm_config.parallel_config
            self._worker = WorkerSide(cfg, agree=parallel.distributed_executor_backend == "external_launcher",
                                      tp=parallel.tensor_parallel_size)

    @property
    def planner(self) -> ExternalPlanner:
        """The scheduler side's kvdist planner (``stats()`` for operators)."""
        return self._s.planner

    def saving(self) -> set[str]:
        """Scheduler side: the requests whose blocks vLLM keeps for a save in flight."""
        return self._s.saving()

    @property
    def kvdist(self) -> ExternalCache:
        """The worker side's kvdist rank (``stats()``, ``executor``), once registered."""
        return self._w.cache

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Layer-compact, token-major pages (FlashAttention's own default): an engine
        block of one layer is one dense byte run, one piece of a kvdist block."""
        return "LBNHC"

    # -- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._w.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVDistHandshake:
        """The tiers this worker's ranks committed, for the scheduler's planner."""
        return self._w.handshake()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KVDistConnectorMetadata), \
            f"unexpected metadata {type(kv_connector_metadata).__name__}"
        self._w.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._w.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._w.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """No copy per layer: kvdist saves whole blocks at ``wait_for_save``; the last
        layer's call times the forward (worker module docstring)."""
        self._w.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        """Issue the step's saves behind the forward; waits for none of them (vLLM keeps
        a finished request's blocks until ``get_finished`` names it)."""
        self._w.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        saved, loaded = self._w.get_finished(self._meta())
        return saved or None, loaded or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._w.load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._w.report()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # -- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._s.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._s.update_state_after_alloc(request, blocks, num_external_tokens)

    def on_new_request(self, request: Request) -> None:
        self._s.on_new_request(request)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._s.build_connector_meta(scheduler_output)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Every worker's committed tiers (``get_handshake_metadata``), which vLLM hands
        over after the workers registered their KV caches and before the first step."""
        for rank, meta in metadata.items():
            assert isinstance(meta, KVDistHandshake), f"worker {rank}: unexpected {type(meta).__name__}"
        self._s.adopt(metadata)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._s.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._s.request_finished(request, block_ids)

    # -- helpers -----------------------------------------------------------------------------
    @property
    def _s(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side call on a worker's connector"
        return self._scheduler

    @property
    def _w(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side call on the scheduler's connector"
        return self._worker

    def _meta(self) -> KVDistConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVDistConnectorMetadata), f"unexpected metadata {type(meta).__name__}"
        return meta
