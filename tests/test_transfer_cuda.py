"""The five transfer races of ``test_transfer_scenarios.py`` on a real GPU: the GPU tier
in CUDA memory, a pinned host tier, the CUDA executor's streams and batched copies.

A "held" stream is gated deterministically (``cuda_gate.SpinGate``: a kernel spinning
on a host flag, no sleeps). So a missing dependency shows up as wrong bytes every time,
and a present one as right bytes. The gate gives up after a few seconds, a safety net
that turns a test bug into a failure (``expired``) instead of a hang; scenario 4 uses it
to show a dependency that should not exist."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvdist
import kvdist.testing
from kvdist.testing import Seams
from kvdist.transfer import ALL_RULES, OFFLOAD, ONBOARD

from .cuda_gate import SpinGate
from .test_transfer_scenarios import SCENARIOS, SimHarness, fill, host_tag, tag_of

pytestmark = pytest.mark.gpu

class CudaHarness:
    """The scenario driver of test_transfer_scenarios.py on CUDA."""

    def __init__(self, cfg: dict, rules=ALL_RULES, tracking: str = "slot", path: str | None = None):
        self.seams = Seams(rules=rules, tracking=tracking, copy_path=path, batch_log=[])
        self.cache = kvdist.testing.create(cfg, self.seams)
        assert self.cache.device.type == "cuda" and self.seams.host.raw.is_pinned()
        self.engine = self.seams.engine
        self.ex = self.seams.executor
        self.reused: dict[object, int] = {}
        self._gates: list[SpinGate] = []
        self.expired = 0

    def _stream(self, name: str) -> torch.cuda.Stream:
        return torch.cuda.current_stream() if name == "compute" else self.ex.streams[name]

    def hold(self, stream: str) -> None:
        self._gates.append(SpinGate(timeout_s=4.0).close(self._stream(stream)))

    def release_all(self) -> None:
        for g in self._gates:
            g.open()
        torch.cuda.synchronize()
        self.expired += sum(g.expired for g in self._gates)
        self._gates.clear()

    def block_table(self, seq_ids: list) -> torch.Tensor:
        return self.cache.block_table(seq_ids)  # the GPU waits (S5); the host does not

    def go(self) -> None:
        self.release_all()

    def kernel_write(self, slot: int, tag: float) -> None:
        fill(self.cache, slot, tag)  # on the compute (current) stream

    def kernel_read(self, slot: int):
        c = self.cache
        seen = torch.stack([c.kv_pool(layer)[slot] for layer in range(c.layout.num_layers)]).clone()
        return lambda: tag_of(seen)

    def host_tag(self, slot: int):
        return host_tag(self.seams, slot)

    def onboard_completes_while_offload_held(self) -> bool:
        self.ex.streams["onboard"].synchronize()  # the onboard batch is all it holds
        return not self._gates[0].expired

    def close(self) -> None:
        for g in self._gates:
            g.open()
        torch.cuda.synchronize()
        self.cache.close()

    # The step helpers are the simulation harness's.
    add, compute, prefill = SimHarness.add, SimHarness.compute, SimHarness.prefill
    mark, moves = SimHarness.mark, SimHarness.moves


def _run(cfg_factory, name: str, rule_on: bool, path: str | None,
         groups: int = 1) -> tuple[dict, dict, CudaHarness]:
    fn, (gpu, host), right, (rules_off, tracking_off) = SCENARIOS[name]
    # Whole-step S5, as these scenarios were written for (the rule-off cases); with 2
    # layer groups every copy between GPU and host goes group by group, each group
    # following the same group of the batches it depends on (S2 per group).
    cfg = cfg_factory(gpu=gpu, host=host, device="cuda", layer_groups=groups)
    rules, tracking = (ALL_RULES, "slot") if rule_on else (rules_off, tracking_off)
    h = CudaHarness(cfg, rules, tracking, path)
    try:
        return fn(h), right, h
    finally:
        h.close()


@pytest.mark.parametrize("groups", [1, 2], ids=["whole", "by-layer"])
@pytest.mark.parametrize("path", ["memcpy-batch", "runs", "per-block"])
@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_exact_bytes_with_the_rule_on_cuda(cfg_factory, name, path, groups):
    got, right, h = _run(cfg_factory, name, True, path, groups)
    assert got == right
    assert h.expired == 0, "a gate gave up: the rule-on case waited on held work it should not need"


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_rule_off_goes_wrong_on_cuda(cfg_factory, name):
    # Scenario 1 puts two copies into one host slot inside one batch, which has no
    # order by definition; the serial path issues them by source slot, so A lands last.
    path = "runs" if name == "1-same-host-slot" else None
    got, right, h = _run(cfg_factory, name, False, path)
    print(f"\n{name} rule off on CUDA: {got} (right: {right}), copy path {h.ex.path}")
    if name == "4-gpu-and-host-slot0":
        assert got == {**right, "onboard independent of the held offload": False}
        assert h.expired == 1  # the onboard completed only once the offload's gate gave up
    else:
        assert got != right
        assert h.expired == 0


@pytest.mark.parametrize("groups", [1, 2])
def test_batched_path_is_used_and_visible_in_stats(cfg_factory, groups):
    """Many scattered blocks move as one cudaMemcpyBatchAsync submission per batch and
    layer group (the test geometry has 2 layers: 2 groups at most): whole blocks with
    runs merged, or each block's slice of a group one copy of its own."""
    from kvdist.transfer.batchcopy import coalesce

    seams = Seams()
    cache = kvdist.testing.create(cfg_factory(gpu=64, host=64, device="cuda", layer_groups=groups), seams)
    try:
        ex = seams.executor
        if ex.copier.batch_api is None:
            pytest.skip("this CUDA runtime has no cudaMemcpyBatchAsync")
        g, h = seams.gpu.raw, seams.host.raw
        g.copy_(torch.arange(g.numel(), device=g.device, dtype=torch.int64).to(torch.uint8).view_as(g))
        rng = np.random.default_rng(1)
        src, dst = rng.permutation(64)[:40], rng.permutation(64)[:40]
        engine, G = seams.engine, seams.manager.space.base[1]
        engine.begin_step()
        for s, d in zip(src.tolist(), dst.tolist()):
            engine.copy(OFFLOAD, s, G + d)
        engine.before_compute()
        cache.synchronize()
        assert torch.equal(h[torch.as_tensor(dst)], g[torch.as_tensor(src)].cpu())
        st = cache.stats()["transfer"]
        assert st["batches_by_path"] == {"memcpy-batch": groups}
        runs = len(coalesce(src, dst, 0, h.shape[0])[0]) if groups == 1 else 40 * groups
        assert st["copy_entries"] == runs
        back = rng.permutation(64)[:40]  # host dst -> GPU back: one copy per block and group
        g.zero_()
        engine.begin_step()
        for s, d in zip(dst.tolist(), back.tolist()):
            engine.copy(ONBOARD, G + s, d)
        engine.before_compute(layered=groups > 1)
        for layer in range(2):
            engine.before_layer(layer)
        cache.synchronize()
        assert torch.equal(g[torch.as_tensor(back)].cpu(), h[torch.as_tensor(dst)])
        st = cache.stats()["transfer"]
        assert st["batches_by_path"] == {"memcpy-batch": 2 * groups}
        assert st["copy_calls_by_path"] == {"memcpy-batch": 2 * groups}
        onboard_entries = 40 * groups if groups > 1 else len(coalesce(dst, back)[0])
        assert st["copy_entries"] == runs + onboard_entries
        assert cache.stats()["transfer_path"] == "memcpy-batch"
    finally:
        cache.close()


def test_disk_directions_on_worker_threads_keep_bytes(cfg_factory):
    """Spill, demote and reload through the worker threads, checked by the integrity churn."""
    from .test_integrity import churn

    cache = kvdist.create(cfg_factory(gpu=24, host=8, disk=128, device="cuda"))
    try:
        d = churn(cache, steps=120)
        s = cache.stats()
        assert s["hit_tokens"]["disk"] > 0 and s["blocks_moved"]["demote"] > 0
        assert d.mismatched_tokens == 0, d.first_mismatch
        print(f"\nCUDA churn with disk workers: {s['transfer']}")
    finally:
        cache.close()


def test_cuda_bindings_batch_path_copies_right():
    """The fallback through cuda.bindings (used when ctypes cannot load the runtime)
    copies the same bytes: checks that binding's Python signature on this image."""
    pytest.importorskip("cuda.bindings.runtime")
    from kvdist.transfer.batchcopy import BatchCopier

    c = BatchCopier(torch.device("cuda"))
    call = c._find_bindings_batch()
    if call is None:
        pytest.skip("cuda.bindings has no cudaMemcpyBatchAsync")
    c._batch, c.path = call, "memcpy-batch"
    g = torch.arange(32 * 64, device="cuda", dtype=torch.int32).to(torch.uint8).view(32, 64)
    h = torch.zeros((32, 64), dtype=torch.uint8, pin_memory=True)
    st = torch.cuda.Stream()
    src, dst = np.array([5, 6, 7, 20, 1]), np.array([0, 1, 2, 9, 31])
    assert c.copy(st, g, h, src, dst) == "memcpy-batch"
    st.synchronize()
    assert torch.equal(h[torch.as_tensor(dst)], g[torch.as_tensor(src)].cpu())
    assert c.batch_api == "cuda-bindings" and c.api_calls["memcpy-batch"] == 1
