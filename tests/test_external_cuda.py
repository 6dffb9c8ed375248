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


@pytest.mark.parametrize("kv_dim,hnd", [(None, False), (0, False), (0, True), (1, False)],
                         ids=["separate-LBNHC", "KV-apart-NHD", "KV-apart-HND", "flashinfer"])
@pytest.mark.parametrize("layers", [(0, L), (1, 3)], ids=["all", "group"])
def test_one_kernel_moves_exactly_what_torch_indexing_moves(kv_dim, hnd, layers):
    """The staged path's kernel (``kvdist/external/kernels.py``) against torch's indexing,
    per layer, for the layouts whose layers are allocations of their own: the same
    engine blocks written, the same staged bytes read, no other block touched."""
    from kvdist.external import ExternalGpuTier

    from .external_kv import split_kv
    from .test_external_cuda_on_cpu import LAYOUT

    n = 12
    kv = ([t.cuda() for t in vllm_kv(n, "separate")] if kv_dim is None else
          [t.cuda() for t in split_kv(n, kv_dim=kv_dim, hnd=hnd)])
    tier = ExternalGpuTier(LAYOUT, kv, kv_dim=kv_dim or 0)
    assert tier.one_kernel and not tier.stacked
    group = range(*layers)
    blocks = torch.tensor([7, 2, 11, 0, 5], dtype=torch.int64, device="cuda")
    rows = torch.randint(0, 256, (8, LAYOUT.bytes_per_block), dtype=torch.uint8, device="cuda")
    expect = [t.clone() for t in kv]
    reference = ExternalGpuTier(LAYOUT, expect, kv_dim=kv_dim or 0, one_kernel=False)  # a kernel a layer
    assert not reference.one_kernel
    tier.scatter(rows[:5], blocks, group)
    reference.scatter(rows[:5], blocks, group)
    torch.cuda.synchronize()
    for a, b in zip(kv, expect):  # bytes: random bytes are NaNs as float16
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    out = torch.zeros_like(rows)
    ref = torch.zeros_like(rows)
    tier.stage_out(blocks.flip(0), out[:5], group)
    reference.stage_out(blocks.flip(0), ref[:5], group)
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
    lo, hi = LAYOUT.bytes_per_layer * group.start, LAYOUT.bytes_per_layer * group.stop
    assert torch.equal(out[:5, lo:hi], rows[:5].flip(0)[:, lo:hi])  # what went in comes out
    assert not out[:5, :lo].any() and not out[:5, hi:].any() and not out[5:].any()


@pytest.mark.parametrize("groups", [1, L], ids=["whole", "by-layer"])
@pytest.mark.parametrize("gather,order", [("direct", "separate"), ("staged", "separate"), ("staged", "LBNHC"),
                                          ("rows", "BLNHC")])
def test_a_failed_disk_read_on_cuda_reports_its_blocks_and_the_step_goes_on(monkeypatch, tmp_path, gather,
                                                                            order, groups):
    """On CUDA, what a failed disk read does on CPU (``tests/vllm``: vLLM then recomputes
    the blocks): ``test_external_cuda_on_cpu.failed_disk_read``."""
    from .test_external_cuda_on_cpu import failed_disk_read

    cfg = config(host_blocks=2, disk_blocks=8, disk_path=str(tmp_path), layer_groups=groups)
    cfg["cache"]["device"] = "cuda"
    failed_disk_read(vllm_kv(12, order, device="cuda"), cfg, gather, monkeypatch,
                     lambda: torch.cuda.current_stream().synchronize())


@pytest.mark.parametrize("kv_dim", [None, 1], ids=["separate-LBNHC", "flashinfer"])
@pytest.mark.parametrize("layers", [(0, L), (1, 3)], ids=["all", "group"])
def test_the_kernel_moves_rows_packed_with_a_groups_layers_alone(kv_dim, layers):
    """The staged path's rows hold a layer group's bytes alone (``packed``): the kernel
    writes and reads the same engine bytes as torch's indexing does from whole rows."""
    from kvdist.external import ExternalGpuTier

    from .external_kv import split_kv
    from .test_external_cuda_on_cpu import LAYOUT

    n = 12
    kv = ([t.cuda() for t in vllm_kv(n, "separate")] if kv_dim is None else
          [t.cuda() for t in split_kv(n, kv_dim=kv_dim)])
    tier = ExternalGpuTier(LAYOUT, kv, kv_dim=kv_dim or 0)
    assert tier.one_kernel and not tier.stacked
    expect = [t.clone() for t in kv]
    reference = ExternalGpuTier(LAYOUT, expect, kv_dim=kv_dim or 0, one_kernel=False)
    group = range(*layers)
    lo, hi = LAYOUT.bytes_per_layer * group.start, LAYOUT.bytes_per_layer * group.stop
    blocks = torch.tensor([7, 2, 11, 0, 5], dtype=torch.int64, device="cuda")
    rows = torch.randint(0, 256, (5, LAYOUT.bytes_per_block), dtype=torch.uint8, device="cuda")
    tier.scatter(rows[:, lo:hi].contiguous(), blocks, group, packed=True)
    reference.scatter(rows, blocks, group)
    torch.cuda.synchronize()
    for a, b in zip(kv, expect):
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    out = torch.zeros((5, hi - lo), dtype=torch.uint8, device="cuda")
    tier.stage_out(blocks.flip(0), out, group, packed=True)
    torch.cuda.synchronize()
    assert torch.equal(out, rows.flip(0)[:, lo:hi])
