"""The simulation's model on a GPU: a cached forward pass (reuse, decodes, grouped-query
heads, bfloat16, FlashAttention over the paged pool) equals a from-scratch recompute
within the run's logits tolerance. The kernels themselves: tests/test_attention.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvdist
from kvdist.sim.engine.model import Decoder, Geometry, Segment
from kvdist.sim.engine.parallel import TensorParallel
from kvdist.sim.experiment.checks import logits_tolerance

from .conftest import make_cfg

pytestmark = pytest.mark.gpu


def _cache(layers=4, heads=2, dim=64, blocks=64):
    return kvdist.create(make_cfg(
        model={"num_layers": layers, "num_kv_heads": heads, "head_dim": dim, "dtype": "bfloat16"},
        cache={"device": "cuda", "tokens_per_block": 16, "gpu": {"blocks": blocks}}))


def _model(cache, tp: TensorParallel, seed: int) -> Decoder:
    """A small bfloat16 model over ``cache``'s geometry (its K/V heads, 4 query heads each)."""
    lay = cache.layout
    return Decoder(Geometry(lay.num_layers, lay.num_kv_heads, lay.head_dim, q_per_kv=4, hidden=512, ffn=1024,
                            vocab=1000),
                   seed=seed, tp=tp, device=cache.device, kv_dtype=torch.bfloat16,
                   compute_dtype=torch.bfloat16, tokens_per_block=16)


def test_cached_forward_equals_a_recompute_in_bfloat16():
    cache = _cache()
    tp = TensorParallel()
    try:
        model = _model(cache, tp, seed=2)
        assert model.attention.kernel == "flash"
        tol = logits_tolerance(torch.bfloat16, torch.bfloat16)
        rng = np.random.default_rng(0)
        a = rng.integers(0, 1000, 150).astype(np.int32)
        cache.begin_step()
        cache.add_sequence(0, a.tolist())
        table = cache.block_table([0])
        model.forward_cached(cache, table, [Segment(0, 0, a)])
        cache.end_step()
        cache.release(0)
        b = np.concatenate([a[:140], rng.integers(0, 1000, 30).astype(np.int32)])
        cache.begin_step()
        reused = cache.add_sequence(1, b.tolist())
        cache.add_sequence(2, a[:20].tolist())
        assert reused == 128
        table = cache.block_table([1, 2])
        segs = [Segment(0, reused, b[reused:]), Segment(1, 0, a[:20])]
        logits, _ = model.forward_cached(cache, table, segs)
        cache.end_step()
        for got, toks in ((logits[0], b), (logits[1], a[:20])):
            ref = model.forward_dense(toks)
            diff = float((got - ref).abs().max())
            print(f"max |logit diff| {diff:.3e} of max |logit| {float(ref.abs().max()):.2f}")
            assert diff <= tol * max(1.0, float(ref.abs().max()))
    finally:
        cache.close()
        tp.free()


def test_a_step_replayed_from_cuda_graphs_equals_the_eager_step():
    """Piecewise CUDA graphs (``Decoder.capture_graphs``) compute the same step: the same
    K/V into the same pool slots and the same logits (bfloat16 matmuls of another row
    count may round differently: within the run's tolerance), for steps in a bucket,
    padded into a larger one, and past the largest (eager)."""
    cache = _cache(blocks=96)
    tp = TensorParallel()
    try:
        lay = cache.layout
        model = _model(cache, tp, seed=3)
        assert model.can_capture()
        tol = logits_tolerance(torch.bfloat16, torch.bfloat16)
        rng = np.random.default_rng(1)
        prompts = [rng.integers(0, 1000, n).astype(np.int32) for n in (150, 40, 200)]
        cache.begin_step()
        for rid, p in enumerate(prompts):
            cache.add_sequence(rid, p.tolist())
        table = cache.block_table([0, 1, 2])
        cache.end_step()
        seg = (lambda rid, start: Segment(rid, start, prompts[rid][start:]))  # noqa: E731
        steps = [  # (segments, bucket): a prefill and decodes; decodes alone; past the buckets
            ([seg(0, 100), seg(1, 39), seg(2, 199)], 64), ([seg(0, 149), seg(2, 199)], 8),
            ([seg(2, 0)], None)]
        cache.begin_step()
        pool = [cache.kv_pool(layer) for layer in range(lay.num_layers)]
        cache.end_step()
        before = [torch.randn(p.shape, device=p.device).to(p.dtype) for p in pool]  # what attention reads

        def run(segs):
            for p, b in zip(pool, before):
                p.copy_(b)
            cache.begin_step()
            logits, written = model.forward_cached(cache, table, segs)
            cache.end_step()
            return logits.clone(), written.clone(), [p.ne(b) for p, b in zip(pool, before)]

        eager = [run(segs) for segs, _ in steps]
        model.capture_graphs(buckets=(8, 64))
        for (segs, bucket), (e_logits, e_written, e_changed) in zip(steps, eager):
            logits, written, changed = run(segs)
            assert model.graphs.fits(sum(len(s.tokens) for s in segs)) == (bucket is not None)
            assert float((logits - e_logits).abs().max()) <= tol * max(1.0, float(e_logits.abs().max()))
            assert float((written.float() - e_written.float()).abs().max()) <= 0.05 * float(
                e_written.float().abs().max())
            for layer in range(lay.num_layers):  # the same slots written, and only those
                assert torch.equal(changed[layer], e_changed[layer]), f"layer {layer}: other slots written"
                assert int(changed[layer].any(-1).any(-1).sum()) > 0
    finally:
        cache.close()
        tp.free()
