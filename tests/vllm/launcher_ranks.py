"""vLLM's ``external_launcher`` with the connector, as far as it runs without a model:
each process one engine (its own ``Scheduler``) with one TP worker, joined as vLLM's
worker joins them (``init_worker_distributed_environment`` over ``env://``, gloo on
CPU: vLLM's TP group), the worker-side connector built by vLLM itself from the
``KVTransferConfig`` (``ensure_kv_transfer_initialized``, which also broadcasts the
engine id over the TP group), its KV caches registered (kvdist's start-up consensus), its
handshake keyed ``(pp_rank, tp_rank)`` as vLLM's worker keys it. Request ``a`` is saved
and ``b`` loads its 3 blocks; each rank writes what it saw to ``OUT/rank<r>.json``.
``test_external_launcher.py`` starts it.

    mpiexec -n 2 python -m tests.vllm.launcher_ranks OUT mpiexec    (launcher_env() from MPI)
    RANK=.. WORLD_SIZE=.. python -m tests.vllm.launcher_ranks OUT torchrun   (no MPI)"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .harness import (
    BLOCK,
    HEADS,
    LAYERS,
    NUM_BLOCKS,
    PROMPT,
    TAIL,
    Engine,
    expected,
    model_config,
    request,
    vllm_config,
)


def main(out: Path, launcher: str) -> None:
    got: dict = {}
    try:
        if launcher == "mpiexec":
            from kvdist.integrations.vllm import launcher_env

            got["env"] = launcher_env()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # external_launcher asks for it
        rank, tp = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        got["rank"] = rank
        run(out, rank, tp, int(os.environ["LOCAL_RANK"]), got)
    except Exception as exc:  # noqa: BLE001 - the test reads it
        got["error"] = f"{type(exc).__name__}: {exc}"
    (out / f"rank{got.get('rank', os.environ.get('RANK', 'x'))}.json").write_text(json.dumps(got),
        encoding="utf-8")


def run(out: Path, rank: int, tp: int, local_rank: int, got: dict) -> None:
    from vllm.config import ParallelConfig, set_current_vllm_config
    from vllm.distributed.kv_transfer import ensure_kv_transfer_initialized, get_kv_transfer_group
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

    from .harness import kv_cache_config

    tmp = out / f"rank{rank}"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "kvdist.yaml").write_text("cache:\n  device: cpu\n  host: {bytes: 64KiB}\n"
                                     "  recompute_when_faster: false\n", encoding="utf-8")
    parallel = ParallelConfig(tensor_parallel_size=tp, distributed_executor_backend="external_launcher")
    config = vllm_config(model_config(tmp / "model"), tmp / "kvdist.yaml", NUM_BLOCKS, parallel)
    got["executor"] = Executor.get_class(config).__name__
    with set_current_vllm_config(config):
        init_worker_distributed_environment(config, rank, "env://", local_rank, backend="gloo")
        ensure_kv_transfer_initialized(config, kv_cache_config(NUM_BLOCKS, KVCacheLayout.LBNHC, tp))
        worker = get_kv_transfer_group()
        got["tp_rank"] = get_tensor_model_parallel_rank()
        e = Engine(config, NUM_BLOCKS, tp=tp, ranks=[rank], workers=[worker])
        cache = e.worker.kvdist
        got |= {"kvdist_rank": cache.rank, "world_size": cache.world_size, "tiers": list(cache.tiers)}
        e.add(request("a", PROMPT))
        s1 = e.step()
        got["a_blocks"] = list(s1.out.scheduled_new_reqs[0].block_ids[0])
        got["a_sent"] = sorted(e.step().kv.finished_sending or ())
        assert e.scheduler.reset_prefix_cache()
        b = e.add(request("b", PROMPT[:3 * BLOCK] + TAIL))
        s3 = e.step()
        got["b_blocks"] = list(s3.out.scheduled_new_reqs[0].block_ids[0])
        got["s3_scheduled"] = dict(s3.out.num_scheduled_tokens)
        got["s3_invalid"] = sorted(s3.kv.invalid_block_ids or ())
        heads = slice(rank * HEADS // tp, (rank + 1) * HEADS // tp)
        got["b_bytes_ok"] = [
            s3.heads("read", "b", layer)[:3].equal(expected(layer, b.all_token_ids, 0, 3)[:, :, heads])
            for layer in range(len(LAYERS))]
        got["s4_scheduled"] = dict(e.step().out.num_scheduled_tokens)
        e.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
