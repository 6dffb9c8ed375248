"""A vLLM engine core in miniature for the connector's tests: vLLM 0.33.0's real
``Scheduler`` with ``KVDistConnector`` loaded by name from a ``KVTransferConfig``, one
worker-side ``KVDistConnector`` over CPU KV tensors allocated by vLLM's own
``allocate_kv_cache`` (its layout, its strides), and a step that runs what vLLM's model
runner runs around a forward: ``set_forward_context`` and the model-runner connector
context manager (``KVConnectorModelRunnerMixin._get_kv_connector_output``). The forward
is a stand-in with no weights: per layer it waits for the layer's loads
(``wait_for_layer_load``), records the bytes it then reads, writes the K/V of the tokens
it computes (``kv_value``: a function of the layer, the position and the token), and
calls ``save_kv_layer``.

``tp`` > 1 runs that many workers, each with its own connector and tensors holding its
share of the KV heads (worker r: heads r*H/tp..), one after the other in each step, and
joins their outputs with vLLM's ``KVOutputAggregator`` as vLLM's executors do.

The model is a tiny Llama-shaped config (no weights): 2 layers, 2 KV heads of 16, fp16,
16-token blocks."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import set_forward_context
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
from vllm.v1.worker.utils import allocate_kv_cache

from kvdist.external import Job
from kvdist.integrations.vllm import KVDistConnector
from kvdist.transfer import OFFLOAD, SPILL

BLOCK = 16
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
HEADS, HEAD = 2, 16
DTYPE = torch.float16
PAGE = HEADS * BLOCK * 2 * HEAD * 2  # bytes of one block of one layer (all heads): K and V, fp16
EOS = 255
PROMPT = list(range(1, 3 * BLOCK + 6))  # 53 tokens: 3 full blocks and 5
TAIL = [7, 8, 9, 10]
NUM_BLOCKS = 32

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": HEADS,
              "head_dim": HEAD, "num_hidden_layers": len(LAYERS), "vocab_size": 256,
              "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "torch_dtype": "float16",
              "eos_token_id": EOS}


def model_config(tmp: Path) -> ModelConfig:
    """vLLM's ModelConfig of the tiny model: a config.json, no weights, no tokenizer."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(TINY_LLAMA), encoding="utf-8")
    return ModelConfig(model=str(tmp), skip_tokenizer_init=True, dtype="float16", seed=0)


def vllm_config(model: ModelConfig, kvdist_yaml: Path, num_blocks: int,
                parallel: ParallelConfig | None = None, **extra) -> VllmConfig:
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=1024,
                            enable_chunked_prefill=True, is_encoder_decoder=False)
    cache = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto",
                        enable_prefix_caching=True)
    cache.kv_cache_layout = KVDistConnector.get_required_kvcache_layout(None)
    cache.num_gpu_blocks = num_blocks
    kv = KVTransferConfig(kv_connector="KVDistConnector", kv_connector_module_path="kvdist.integrations.vllm",
                          kv_role="kv_both", kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"kvdist_config": str(kvdist_yaml), **extra})
    return VllmConfig(scheduler_config=sched, model_config=model, cache_config=cache, kv_transfer_config=kv,
                      device_config=DeviceConfig("cpu"), parallel_config=parallel or ParallelConfig())


def kv_cache_config(num_blocks: int, layout: KVCacheLayout, tp: int = 1) -> KVCacheConfig:
    """One group of full-attention layers in one backing allocation, placed as vLLM
    places them (``KVCacheTensor``'s docstring: layer-outermost or block-outermost), for
    one of ``tp`` workers (its share of the KV heads)."""
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS // tp, head_size=HEAD, dtype=DTYPE)
    page = PAGE // tp
    assert spec.page_size_bytes == page
    n = len(LAYERS)
    if layout.is_layer_compact:
        strides = dict(layer_stride=page * num_blocks, block_stride=page)
    else:
        strides = dict(layer_stride=page, block_stride=page * n)
    tensor = KVCacheTensor(size=page * num_blocks * n, layers=list(LAYERS), **strides)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[tensor],
                         kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])


def kv_value(layer: int, position: int, token: int) -> torch.Tensor:
    """The K|V the stand-in forward writes for a token: ``[HEADS, 2 * HEAD]``, exact in fp16."""
    base = (layer * 131 + position * 17 + token * 7) % 997
    channel = torch.arange(HEADS * 2 * HEAD, dtype=torch.float32).reshape(HEADS, 2 * HEAD)
    return (base + channel % 23).to(DTYPE)


_hash_ready = False


def request(req_id: str, tokens: list[int], max_tokens: int = 1, cache_salt: str | None = None) -> Request:
    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    params.update_from_generation_config({}, EOS)
    return Request(request_id=req_id, prompt_token_ids=list(tokens), sampling_params=params,
                   pooling_params=None, block_hasher=get_request_block_hasher(BLOCK, sha256),
                   cache_salt=cache_salt)


@dataclass
class Step:
    """What one engine step did: the scheduler's output, the workers' connector output
    (``kv`` aggregated as the scheduler got it, ``per_worker`` as each worker gave it),
    and per layer and worker the bytes the forward read for each request's blocks once
    ``wait_for_layer_load`` returned (``before``: just before it was called)."""

    out: SchedulerOutput
    kv: KVConnectorOutput
    per_worker: list[KVConnectorOutput] = field(default_factory=list)
    read: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)  # (req, layer, worker)
    before: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)

    def heads(self, table: str, req_id: str, layer: int) -> torch.Tensor:
        """``read`` or ``before`` of every worker, their heads side by side:
        ``[blocks, tokens, HEADS, 2*HEAD]``."""
        got = getattr(self, table)
        return torch.cat([got[k] for k in sorted(k for k in got if k[:2] == (req_id, layer))], dim=2)


class Engine:
    def __init__(self, config: VllmConfig, num_blocks: int, layout: KVCacheLayout = KVCacheLayout.LBNHC,
                 tp: int = 1, ranks: list[int] | None = None, workers: list[KVDistConnector] | None = None):
        """``ranks``: the TP workers this process runs (all ``tp`` by default; one, under
        mpiexec, where each MPI rank is one worker with a scheduler of its own, as vLLM's
        ``external_launcher`` runs them). ``workers``: their connectors as vLLM built
        them (``ensure_kv_transfer_initialized``), else built here."""
        self.config = config
        self.tp = tp
        self.ranks = list(range(tp)) if ranks is None else list(ranks)
        kcc = kv_cache_config(num_blocks, layout, tp)
        # vLLM's EngineCore: the workers register their KV caches, then the scheduler is
        # built and gets every worker's handshake metadata (_set_kv_connector_handshake_metadata)
        self.workers = workers or [KVDistConnector(config, KVConnectorRole.WORKER, kcc) for _ in self.ranks]
        self.kvs = [allocate_kv_cache(kcc, torch.device("cpu"), layout) for _ in self.ranks]
        for worker, kv in zip(self.workers, self.kvs):
            worker.register_kv_caches(kv)
        self.scheduler = Scheduler(vllm_config=config, kv_cache_config=kcc, log_stats=True,
                                   structured_output_manager=StructuredOutputManager(config),
                                   block_size=BLOCK)
        self.connector.set_xfer_handshake_metadata_pp_aware(
            {(0, rank): w.get_handshake_metadata() for rank, w in zip(self.ranks, self.workers)})
        self.aggregator = KVOutputAggregator(len(self.ranks))
        self.token = 100

    @property
    def worker(self) -> KVDistConnector:
        return self.workers[0]

    @property
    def connector(self) -> KVDistConnector:
        c = self.scheduler.connector
        assert isinstance(c, KVDistConnector)
        return c

    def close(self) -> None:
        for worker in self.workers:  # what ensure_kv_transfer_shutdown does in each worker
            kv_transfer_state._KV_CONNECTOR_AGENT = worker
            kv_transfer_state.ensure_kv_transfer_shutdown()

    def add(self, req: Request) -> Request:
        self.scheduler.add_request(req)
        return req

    def blocks(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def layer_blocks(self, layer: int, block_ids: list[int]) -> torch.Tensor:
        """The K|V of ``block_ids`` in ``layer``, as ``[blocks, tokens, heads, 2*HEAD]``
        (every worker's heads)."""
        return torch.cat([kv[LAYERS[layer]][block_ids].transpose(1, 2) for kv in self.kvs], dim=2)

    def step(self) -> Step:
        """One engine step; ``Step.kv`` is the workers' connector output as the
        scheduler gets it (aggregated)."""
        out = self.scheduler.schedule()
        sampled = {}
        for req_id in out.num_scheduled_tokens:
            req = self.scheduler.requests[req_id]
            done_prefill = req.num_computed_tokens >= req.num_tokens  # the scheduler advanced it
            sampled[req_id] = [self._next_token()] if done_prefill else []
        ids = list(sampled)
        step = Step(out, KVConnectorOutput())
        outputs = []
        for i, worker in enumerate(self.workers):
            kv_transfer_state._KV_CONNECTOR_AGENT = worker  # what ensure_kv_transfer_initialized sets
            worker.handle_preemptions(out.kv_connector_metadata)  # GPUModelRunner.execute_model
            with set_forward_context(None, self.config), \
                    KVConnectorModelRunnerMixin._get_kv_connector_output(out) as kv:
                if out.total_num_scheduled_tokens:
                    self._forward(step, i)
            step.per_worker.append(kv)
            index = {r: i for i, r in enumerate(ids)}
            outputs.append(ModelRunnerOutput(req_ids=ids, req_id_to_index=index, kv_connector_output=kv,
                                             sampled_token_ids=[sampled[r] for r in ids]))
        mro = self.aggregator.aggregate(outputs, 0)
        step.kv = mro.kv_connector_output
        self.scheduler.update_from_output(out, mro)
        return step

    def _next_token(self) -> int:
        self.token += 1
        return self.token % 200

    def _forward(self, step: Step, i: int) -> None:
        """This process's worker ``i``'s forward: per layer, wait for its loads, read what
        the scheduled requests' blocks hold (its heads), write the K/V of its heads for
        the tokens computed now, then offer the layer for saving."""
        worker, kvs, rank = self.workers[i], self.kvs[i], self.ranks[i]
        heads = HEADS // self.tp
        mine = slice(rank * heads, (rank + 1) * heads)
        for layer, name in enumerate(LAYERS):
            view = kvs[name]  # [B, H, N, C]
            for req_id in step.out.num_scheduled_tokens:
                step.before[req_id, layer, rank] = view[self.blocks(req_id)].transpose(1, 2).clone()
            worker.wait_for_layer_load(name)
            for req_id, n in step.out.num_scheduled_tokens.items():
                req = self.scheduler.requests[req_id]
                blocks = self.blocks(req_id)
                step.read[req_id, layer, rank] = view[blocks].transpose(1, 2).clone()
                first = req.num_computed_tokens - n
                for pos in range(first, first + n):
                    kv = kv_value(layer, pos, req.all_token_ids[pos])[mine]
                    view[blocks[pos // BLOCK], :, pos % BLOCK, :] = kv
            worker.save_kv_layer(name, view, None)


def expected(layer: int, tokens: list[int], first_block: int, n_blocks: int) -> torch.Tensor:
    """What ``layer_blocks`` must read for blocks ``first_block..+n_blocks`` of a prompt."""
    out = torch.empty(n_blocks, BLOCK, HEADS, 2 * HEAD, dtype=DTYPE)
    for b in range(n_blocks):
        for t in range(BLOCK):
            pos = (first_block + b) * BLOCK + t
            out[b, t] = kv_value(layer, pos, tokens[pos])
    return out


def rows(step, part: str = "transfers") -> list[tuple[str, list[int], list[int]]]:
    """The step's planned copies as (route, sources, destinations), grouped by route in
    order: its loads (``transfers``, issued by start_load_kv) or its saves (``saves``,
    issued by wait_for_save)."""
    t = getattr(step.out.kv_connector_metadata, part)
    out: list[tuple[str, list[int], list[int]]] = []
    for route, s, d in zip(t.routes(), t.src.tolist(), t.dst.tolist()):
        if out and out[-1][0] == route.name:
            out[-1][1].append(s)
            out[-1][2].append(d)
        else:
            out.append((route.name, [s], [d]))
    return out


def save_a(e: Engine) -> list[int]:
    """Request ``a`` runs, finishes, and its 3 full blocks are saved; vLLM's prefix cache
    is reset after. Returns a's engine block ids."""
    e.add(request("a", PROMPT))
    s1 = e.step()
    assert s1.out.num_scheduled_tokens == {"a": len(PROMPT)}
    a_blocks = list(s1.out.scheduled_new_reqs[0].block_ids[0])
    assert len(a_blocks) == 4
    # the 3 blocks a's forward completes are saved behind that forward, in step 1
    route = OFFLOAD.name if e.tier == "host" else SPILL.name
    assert rows(s1) == [] and rows(s1, "saves") == [(route, a_blocks[:3], [0, 1, 2])]
    assert s1.out.kv_connector_metadata.saves.jobs == (Job("a", "save", tuple(a_blocks[:3])),)
    assert e.connector.planner.stats()["blocks_used"] == {e.tier: 3}
    # a finished in step 1 with saves planned: vLLM keeps its blocks until the workers say
    assert e.scheduler.requests["a"].status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert not s1.kv.finished_sending and e.connector.saving() == {"a"}
    s2 = e.step()
    assert s2.out.num_scheduled_tokens == {} and rows(s2) == rows(s2, "saves") == []
    assert s2.out.kv_connector_metadata.held == {"a"}
    assert s2.kv.finished_sending == {"a"}
    assert "a" not in e.scheduler.requests  # freed once the workers said the save finished
    assert e.scheduler.reset_prefix_cache()
    return a_blocks
