"""The simulation's attention over the paged pool (``kvdist.sim.engine.attention``): every
kernel, for every segment, equals that segment attended alone with its keys read
position by position through the block table — whole-block gathers padded with
``seqused_k``, decodes packed by K/V head, rows taken from anywhere in the step."""

from __future__ import annotations

import pytest
import torch

from kvdist.sim.engine.attention import PagedAttention, plan_keys
from kvdist.sim.engine.paged_decode import available as paged_available


def _reference(pool, table, q, starts, q_lens):
    """Each segment alone: its keys read position by position through the table, SDPA
    with a bottom-right causal mask."""
    out, a = [], 0
    for row, (s, n) in enumerate(zip(starts, q_lens)):
        pos = torch.arange(s + n, device=q.device)
        blk = table[row, pos // 16].long()
        k, v = pool[blk, 0, pos % 16].to(q.dtype), pool[blk, 1, pos % 16].to(q.dtype)
        mask = pos[None, :] <= torch.arange(s, s + n, device=q.device)[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(
            q[a: a + n].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
            enable_gqa=True)
        out.append(o.transpose(0, 1))
        a += n
    return torch.cat(out)


CASES = [([0, 37, 150, 90], [45, 20, 1, 1]),  # the engine's order: prefills, then decodes
         ([150, 0, 90, 37], [1, 45, 1, 20]),  # interleaved
         ([0, 16], [16, 33]),  # prefills only, whole blocks
         ([31, 15, 159], [1, 1, 1])]  # decodes only, the last key first in its block


# "paged": flash for prefills, decodes out of the pool by the Triton kernel (on the CPU only
# under TRITON_INTERPRET=1 with Triton installed).
@pytest.mark.parametrize("device,kernel,dtype", [
    ("cpu", "sdpa", torch.float32),
    pytest.param("cpu", "paged", torch.float32, marks=pytest.mark.skipif(
        not paged_available(torch.device("cpu")), reason="needs Triton's interpreter (TRITON_INTERPRET=1)")),
    pytest.param("cuda", "sdpa", torch.bfloat16, marks=pytest.mark.gpu),
    pytest.param("cuda", "flash", torch.bfloat16, marks=pytest.mark.gpu),
    pytest.param("cuda", "paged", torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("starts,q_lens", CASES)
def test_attention_over_the_paged_pool_equals_each_segment_alone(device, kernel, dtype, starts, q_lens):
    g = torch.Generator(device=device).manual_seed(0)
    # A pool of 64 blocks of 16 tokens, 2 K/V heads of 64; 4 query heads per K/V head.
    pool = torch.randn(64, 2, 16, 2, 64, generator=g, device=device).to(torch.bfloat16)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1)).to(torch.int32)
    table = perm[:40].view(4, 10).to(device)  # blocks scattered over the pool
    keys = plan_keys(table, list(range(len(starts))), starts, q_lens, 16, paged_decodes=kernel == "paged")
    q = torch.randn(sum(q_lens), 8, 64, generator=g, device=device).to(dtype)
    ref = _reference(pool, table, q, starts, q_lens).float()
    attention = PagedAttention(kv_heads=2, head_dim=64, kernel="sdpa" if device == "cpu" else "flash",
                               paged_decodes=True) if kernel == "paged" else \
        PagedAttention(kv_heads=2, head_dim=64, kernel=kernel)
    got = attention.attend(pool, q, keys).float()
    err = float((got - ref).norm() / ref.norm())
    print(f"\n{kernel} on {device}: relative error {err:.2e}")
    assert err < (1e-5 if dtype == torch.float32 else 1e-2)
