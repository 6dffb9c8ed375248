"""Onboarding layer by layer on a real GPU: the onboard stream is held by a spin gate
(``cuda_gate.SpinGate``) while compute reads each layer through ``kv_pool(layer)``.
With S5 per layer the compute stream waits for each layer's group event and reads
the onboarded bytes once the gate opens; with S5 off it reads the GPU slots before
the copies land and sees their old bytes."""

from __future__ import annotations

import pytest
import torch

import kvdist
import kvdist.testing
from kvdist.seams import Seams
from kvdist.transfer import ALL_RULES

from .conftest import make_cfg
from .cuda_gate import SpinGate

pytestmark = pytest.mark.gpu

LAYERS, TPB = 4, 4


def _write(cache, seq, tokens, tag: float) -> None:
    cache.begin_step()
    cache.add_sequence(seq, tokens)
    blocks = cache.block_table([seq])[0, : len(tokens) // TPB].long()
    for layer in range(LAYERS):
        cache.kv_pool(layer)[blocks] = tag + layer
    cache.end_step()
    cache.release(seq)


def _read_while_onboard_is_held(rules) -> list[float]:
    seams = Seams(rules=frozenset(rules))
    cfg = make_cfg(model={"num_layers": LAYERS, "num_kv_heads": 2, "head_dim": 64, "dtype": "float32"},
                   cache={"device": "cuda", "tokens_per_block": TPB, "gpu": {"blocks": 4},
                          "host": {"bytes": 8 * LAYERS * 2 * TPB * 2 * 64 * 4}, "layer_groups": LAYERS})
    cache = kvdist.testing.create(kvdist.load_config(cfg), seams)
    try:
        a = list(range(8)) + [99]
        _write(cache, "a", a, 10.0)
        _write(cache, "b", list(range(100, 116)), 50.0)  # A's 2 blocks go to the host tier
        # The reads' kernels once before the gate closes: loaded lazily behind it, they
        # would wait for the spin (without CUDA_MODULE_LOADING=EAGER).
        scratch = torch.zeros_like(cache.kv_pool(0))
        scratch[torch.zeros(2, dtype=torch.long, device=scratch.device)].mean().item()
        torch.cuda.synchronize()
        cache.begin_step()
        gate = SpinGate(timeout_s=4.0).close(seams.executor.streams["onboard"])
        assert cache.add_sequence("a2", a) == 8
        blocks = cache.block_table(["a2"])[0, :2].long()
        reads = [cache.kv_pool(layer)[blocks].mean() for layer in range(LAYERS)]  # queued on compute
        gate.open()
        gate.check()
        cache.end_step()
        assert cache.stats()["blocks_moved"]["onboard"] == 2
        return [float(r) for r in reads]
    finally:
        cache.close()


def test_each_layer_waits_for_its_own_copy():
    assert _read_while_onboard_is_held(ALL_RULES) == [10.0 + layer for layer in range(LAYERS)]


def test_rule_off_a_layer_is_read_before_its_copy_lands():
    assert _read_while_onboard_is_held({"S2", "S4"}) == [50.0 + layer for layer in range(LAYERS)]
