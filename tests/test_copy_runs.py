"""Copies between tiers come in runs of adjacent slots, so the copy engine moves a
step's blocks in a few large copies instead of one per block (``coalesce``): an
admission onboards its host and disk hits into its fresh GPU slots lowest source into
lowest slot (``CacheManager._onboard``), which keeps an offloaded run a run on its way
back, and the blocks evicted next a run on their way out.

The pattern is ``bench layerwise``'s: three prompts take turns on a GPU tier that holds
two, so every step offloads one prompt and onboards another."""

from __future__ import annotations

import numpy as np
import pytest

import kvdist
import kvdist.testing
from kvdist.seams import Seams
from kvdist.transfer.batchcopy import coalesce

MODEL = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 8, "dtype": "float32"}


def _turns(n: int, steps: int):
    """Per step, the (route, sources, destinations) of its batches (tier-local slots)."""
    log: list = []
    block = 2 * 2 * 8 * 4
    cache = kvdist.testing.create(kvdist.load_config({"model": MODEL, "cache": {
        "tokens_per_block": 1, "gpu": {"blocks": 2 * (n + 1) + 2}, "host": {"bytes": (3 * n + 8) * block}}}),
        Seams(batch_log=log))
    prompts = [list(range(k * 10**6, k * 10**6 + n)) + [7] for k in range(3)]
    out = []
    try:
        for i in range(steps):
            log.clear()
            cache.begin_step()
            assert cache.add_sequence(i, prompts[i % 3]) == (n if i >= 3 else 0)
            cache.block_table([i])
            cache.end_step()
            if i:
                cache.release(i - 1)
            cache.synchronize()
            cache.check_invariants()
            out.append(list(log))
    finally:
        cache.close()
    return out


def test_a_turn_moves_its_blocks_in_runs_exact():
    steps = _turns(6, 6)
    assert steps[5] == [("offload", [9, 10, 11, 12], [6, 7, 8, 9]),
                        ("onboard", [10, 4, 3, 2], [12, 11, 10, 9])]


@pytest.mark.parametrize("n", [64, 500])
def test_every_turn_coalesces_into_at_most_two_runs_a_direction(n):
    """From the second turn of each prompt on (the first offload of a prompt computed in
    place pairs its blocks, evicted last block first, with ascending host slots)."""
    for i, batches in enumerate(_turns(n, 12)[5:], 5):
        assert sorted(name for name, _, _ in batches) == ["offload", "onboard"], (i, batches)
        for name, src, dst in batches:
            assert len(src) >= n - 2, (i, name, len(src))
            runs = len(coalesce(np.array(src), np.array(dst))[2])
            assert runs <= 2, f"step {i}: {len(src)} {name} copies in {runs} runs"
