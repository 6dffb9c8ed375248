"""Where a step's model time goes on the GPU, and which way of reading K/V out of the
paged pool is fastest. From the repo root of a CUDA machine:

    python3 scripts/gpu/attention_probe.py [--prefills 3 --prefill-tokens 600 --decodes 22 --context 3800]

One representative step of configs/h200.yaml at capacity (Llama-3-8B geometry, 2 MiB
blocks, a few prefills that reuse most of their prompt next to decodes of long
contexts) is timed piece by piece, per layer, side by side in one run:

* the keys gathered token by token (two index tensors: kvdist before 2026-12-01) vs
  block by block (``index_select`` of whole 16-token blocks: ``kvdist.sim.engine.attention``);
* attention as before (that gather, one FlashAttention call over exact key lengths) vs
  now (whole blocks with ``seqused_k``; decodes in a call of their own, query heads
  packed as rows of their K/V head), and how far their outputs differ;
* the whole forward pass (``Decoder.forward_cached``) over a stand-in cache, now, and
  with attention's time as before."""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from kvdist.sim.engine.attention import PagedAttention, plan_keys
from kvdist.sim.engine.model import Decoder, Geometry, Segment
from kvdist.sim.engine.parallel import TensorParallel


def _token_plan(table, starts, q_lens, tpb):
    """The keys as gathered before: every position's (block, offset), exact lengths."""
    dev = table.device
    k = np.asarray(starts) + np.asarray(q_lens)
    rows = np.repeat(np.arange(len(k)), k)
    pos = np.concatenate([np.arange(n) for n in k])
    block = table[torch.from_numpy(rows).to(dev), torch.from_numpy(pos // tpb).to(dev)].long()
    cu = (lambda a: torch.from_numpy(np.concatenate([[0], np.cumsum(a)]).astype(np.int32)).to(dev))
    return block, torch.from_numpy(pos % tpb).to(dev), cu(q_lens), cu(k)


def timed(fn, reps: int = 20) -> float:
    """Median seconds of ``fn`` on the device."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return float(np.median(out))


class PoolCache:
    def __init__(self, pool: torch.Tensor):
        self.pool = pool

    def kv_pool(self, layer: int) -> torch.Tensor:
        return self.pool[:, layer]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefills", type=int, default=3)
    ap.add_argument("--prefill-tokens", type=int, default=600)
    ap.add_argument("--decodes", type=int, default=22)
    ap.add_argument("--context", type=int, default=3800)
    ap.add_argument("--blocks", type=int, default=6144)
    a = ap.parse_args()
    dev = torch.device("cuda:0")
    print("torch", torch.__version__, torch.cuda.get_device_name(0))
    print(torch.ops.aten._flash_attention_forward.default._schema)
    L, H, D, tpb, Hq = 32, 8, 128, 16, 32
    pool = torch.randn(a.blocks, L, 2, tpb, H, D, device=dev, dtype=torch.bfloat16)
    rng = np.random.default_rng(0)
    starts = [a.context - a.prefill_tokens] * a.prefills + [a.context] * a.decodes
    q_lens = [a.prefill_tokens] * a.prefills + [1] * a.decodes
    n = len(starts)
    width = -(-max(s + q for s, q in zip(starts, q_lens)) // tpb)
    # Rows may share blocks (as the timing does not care).
    table = torch.from_numpy(rng.integers(0, a.blocks, (n, width)).astype(np.int32)).to(dev)
    rows = list(range(n))
    Tq, Tk = sum(q_lens), sum(starts) + sum(q_lens)
    print(f"step: {a.prefills} prefills of {a.prefill_tokens} tokens + {a.decodes} decodes, context "
          f"{a.context}: {Tq} queries, {Tk} keys ({Tk * H * D * 2 * 2 / 2**20:.0f} MiB of K/V a layer)")
    q = torch.randn(Tq, Hq, D, device=dev, dtype=torch.bfloat16)
    layer = pool[:, 5]

    # -- gathers: one layer's K and V for the step ------------------------------------------------
    k_lens = np.asarray(starts) + np.asarray(q_lens)
    old = _token_plan(table, starts, q_lens, tpb)
    nblk = -(-k_lens // tpb)
    r_idx = torch.from_numpy(np.repeat(np.arange(n), nblk)).to(dev)
    c_idx = torch.from_numpy(np.concatenate([np.arange(b) for b in nblk])).to(dev)
    blocks = table[r_idx, c_idx].long()

    def per_token():
        return layer[:, 0][old[0], old[1]], layer[:, 1][old[0], old[1]]

    def per_block():
        return layer[:, 0].index_select(0, blocks), layer[:, 1].index_select(0, blocks)

    for name, fn, elems in [("token by token (before)", per_token, Tk),
                            ("block by block (index_select)", per_block, int(nblk.sum()) * tpb)]:
        s = timed(fn)
        rate = 2 * elems * H * D * 2 / s / 1e9
        print(f"gather {name:30s} {s * 1e3:7.3f} ms/layer  {rate:7.0f} GB/s written")

    # -- attention: before (token gather, one call) vs now (block gather, decodes packed) ---------
    fa = torch.ops.aten._flash_attention_forward

    def before():
        k, v = per_token()
        return fa(q, k, v, old[2], old[3], int(max(q_lens)), int(k_lens.max()), 0.0, True, False)[0]

    flash = PagedAttention(kv_heads=H, head_dim=D, kernel="flash")
    keys = plan_keys(table, rows, starts, q_lens, tpb)
    ref, out = before(), flash.attend(layer, q, keys)
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    s_before, s_now = timed(before), timed(lambda: flash.attend(layer, q, keys))
    k, v = per_token()
    s_kernel = timed(lambda: fa(q, k, v, old[2], old[3], max(q_lens), int(k_lens.max()), 0.0, True, False))
    print(f"attention before: token gather + one flash call     {s_before * 1e3:7.3f} ms/layer "
          f"(kernel {s_kernel * 1e3:.3f})")
    print(f"attention now: block gather + flash, decodes packed {s_now * 1e3:7.3f} ms/layer"
          f" = {s_now / s_before:.2f}x; max |diff| / max |out| {err:.1e}")

    # -- the whole forward pass of the step, now -----------------------------------------------
    g = Geometry(L, H, D, 4, 4096, 14336, 128256)
    model = Decoder(g, seed=0, tp=TensorParallel(None), device=dev, kv_dtype=torch.bfloat16,
                    compute_dtype=torch.bfloat16, tokens_per_block=tpb)
    cache = PoolCache(pool)
    segs = [Segment(i, s, rng.integers(0, g.vocab, ql).astype(np.int32))
            for i, (s, ql) in enumerate(zip(starts, q_lens))]
    s_fwd = timed(lambda: model.forward_cached(cache, table, segs), reps=5)
    print(f"whole forward pass now: {s_fwd * 1e3:.1f} ms, of which attention {L * s_now * 1e3:.1f} ms; "
          f"before: {(s_fwd + L * (s_before - s_now)) * 1e3:.1f} ms")

if __name__ == "__main__":
    main()
