"""Onboarding layer by layer (``cache.layer_groups``), on simulated asynchronous streams:
each layer's K/V lands in the GPU tier only when compute first reads that layer
(``kv_pool(layer)``, rule S5 per layer) — so layer 0 is read while the later layers
are still on their way — and with S5 off a layer is read before its copy lands and
holds the old bytes."""

from __future__ import annotations

import pytest
import torch

import kvdist
import kvdist.testing
from kvdist.seams import Seams
from kvdist.transfer import ALL_RULES

from .conftest import make_cfg

LAYERS, TPB = 4, 4


def _cache(groups: int, rules=ALL_RULES):
    cfg = make_cfg(model={"num_layers": LAYERS, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"},
                   cache={"tokens_per_block": TPB, "gpu": {"blocks": 4}, "host": {"bytes": 8 * 2048},
                          "simulate_async": True, "layer_groups": groups})
    return kvdist.testing.create(kvdist.load_config(cfg), Seams(rules=frozenset(rules)))


def _layer_view(pool0: torch.Tensor, layer: int) -> torch.Tensor:
    """Layer ``layer`` of the GPU tier, reached from layer 0's view without asking the
    cache (no wait): the bytes the memory holds right now."""
    step = pool0[0].numel()  # one layer of one block; blocks are [layer, ...] contiguous
    return pool0.as_strided(pool0.shape, pool0.stride(), pool0.storage_offset() + layer * step)


def _write(cache, seq, tokens, tag: float) -> None:
    """One step computing ``tokens``: every layer's K/V of its blocks is ``tag + layer``."""
    cache.begin_step()
    cache.add_sequence(seq, tokens)
    table = cache.block_table([seq])  # filled when the kernel queued behind its copy runs
    compute = cache.simulated_compute

    def kernel():
        blocks = table[0, : len(tokens) // TPB].long()
        for layer in range(LAYERS):
            cache.kv_pool(layer)[blocks] = tag + layer
    compute.force(compute.kernel(kernel))
    cache.end_step()
    cache.release(seq)


def _onboard_and_read(cache, raw0: torch.Tensor) -> tuple[list[float], list[list[float]]]:
    """Prompt A's 2 blocks are pushed to the host tier, then reused (onboarded). A
    kernel reads each layer right after ``kv_pool(layer)``; before each call it also
    notes what every layer's memory holds (through ``raw0``, layer 0's view taken
    before the step). Returns (what each layer read, the memory of each layer just
    before layer l's kv_pool, as [l][layer])."""
    a = list(range(8)) + [99]
    _write(cache, "a", a, 10.0)  # blocks of A: layer l holds 10 + l
    _write(cache, "b", list(range(100, 116)), 50.0)  # 4 blocks: A's 2 go to the host tier
    cache.begin_step()
    assert cache.add_sequence("a2", a) == 8  # both blocks onboarded from the host
    table = cache.block_table(["a2"])
    compute = cache.simulated_compute
    read, before = [], []

    def kernel():
        blocks = table[0, :2].long()
        for layer in range(LAYERS):
            before.append([float(_layer_view(raw0, k)[blocks].mean()) for k in range(LAYERS)])
            read.append(float(cache.kv_pool(layer)[blocks].mean()))
    compute.force(compute.kernel(kernel))
    cache.end_step()
    return read, before


@pytest.mark.parametrize("groups", [LAYERS, 2])
def test_each_layer_lands_when_it_is_read_and_not_before(groups):
    cache = _cache(groups)
    try:
        read, before = _onboard_and_read(cache, cache.kv_pool(0))
        assert read == [10.0 + layer for layer in range(LAYERS)]  # every layer read its own bytes
        group = [layer * groups // LAYERS for layer in range(LAYERS)]
        for layer in range(LAYERS):
            for k in range(LAYERS):
                landed = layer > 0 and group[k] <= group[layer - 1]  # waited for by an earlier read
                assert (before[layer][k] == 10.0 + k) == landed, (layer, k, before[layer])
        cache.check_invariants()
    finally:
        cache.close()


def test_rule_off_a_layer_is_read_before_its_copy_lands():
    """S5 off: nothing makes compute wait; layer l is read while its copy is still
    queued, so it holds what the GPU slot held before (B's blocks: 50 + l)."""
    cache = _cache(LAYERS, rules={"S2", "S4"})
    try:
        read, _ = _onboard_and_read(cache, cache.kv_pool(0))
        assert read == [50.0 + layer for layer in range(LAYERS)], read
    finally:
        cache.close()
