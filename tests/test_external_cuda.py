"""``cache.gpu: external`` on a real GPU (marked ``gpu``: ``make gpu-test``): the worker
path over CUDA tensors laid out as vLLM lays out its KV, every way of moving a block
(``direct``, ``staged``, ``rows``), the engine's layers in one allocation or one each,
whole and by layer group: saved blocks loaded into other engine blocks hold their
bytes, layer by layer, and no other engine block changes."""

from __future__ import annotations

import pytest
import torch

from kvdist.external import ExternalPlanner, create

from .external_kv import L, T, config, snapshot, vllm_kv

pytestmark = pytest.mark.gpu

PROMPT = list(range(1000, 1000 + 6 * T + 1))


@pytest.mark.parametrize("groups", [1, L], ids=["whole", "by-layer"])
@pytest.mark.parametrize("gather,order", [(g, o) for g in ("direct", "staged")
                                          for o in ("LBNHC", "separate", "BLNHC")] + [("rows", "BLNHC")])
def test_saved_blocks_load_into_other_engine_blocks_on_cuda(gather, order, groups, tmp_path):
    cfg = config(host_blocks=4, disk_blocks=8, disk_path=str(tmp_path), layer_groups=groups)
    cfg["cache"]["device"] = "cuda"
    kv = vllm_kv(16, order, device="cuda")
    worker = create(cfg, device=torch.device("cuda", 0))
    try:
        worker.register(kv, gather=gather)
        assert worker.executor.stats()["gather"] == gather
        planner = ExternalPlanner(cfg, worker.tier_plan)
        before = snapshot([t.cpu() for t in kv])
        planner.plan_save("a", PROMPT, [3, 7, 1, 12, 5, 9])  # 4 in host, 2 demoted to disk
        worker.start(planner.take())
        load = planner.plan_load("b", PROMPT, [0, 2, 4, 6, 8, 10])
        assert load.failed == ()
        worker.start(planner.take())
        for layer in range(L):
            worker.wait_layer(layer)
        torch.cuda.current_stream().synchronize()
        worker.synchronize()
        moved = {0: 3, 2: 7, 4: 1, 6: 12, 8: 5, 10: 9}
        now = snapshot([t.cpu() for t in kv])
        for layer in range(L):
            for b in range(16):
                assert torch.equal(now[layer][b], before[layer][moved.get(b, b)]), (layer, b)
        assert worker.finished().loaded == {"b"}
    finally:
        worker.close()
