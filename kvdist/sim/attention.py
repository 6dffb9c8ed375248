"""Attention of a step's new tokens over the paged pool, read through the block table.

Every segment (a prefill's new tokens, or one decode token) attends to all of its
sequence's positions before it and to itself (causal, aligned to the end: the last
query sees every key). The keys of all segments are gathered from ``kv_pool(layer)``
once per layer, position by position through the table (``plan_keys`` builds the
indices once per step), so reused blocks are read where the cache put them.

Two kernels:

* ``flash`` (CUDA, 16-bit K/V): one variable-length FlashAttention call for the whole
  step (``aten._flash_attention_forward`` with cumulative lengths; grouped-query heads
  natively; ``is_causal`` is bottom-right aligned in the varlen kernel), as a serving
  engine's paged prefill+decode kernel would run it;
* ``sdpa`` (CPU, or any other dtype): ``scaled_dot_product_attention`` per prefill
  segment with an explicit bottom-right causal mask, and one padded batch for the
  one-token segments."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(slots=True)
class KeyPlan:
    """Where every key of a step's segments lives in the pool, and the segments'
    boundaries among the queries (``cu_q``) and among the gathered keys (``cu_k``)."""

    block: torch.Tensor  # [Tk] pool block of each key position
    offset: torch.Tensor  # [Tk] token offset inside that block
    cu_q: torch.Tensor  # int32 [n + 1] on the device
    cu_k: torch.Tensor  # int32 [n + 1] on the device
    q_lens: np.ndarray  # host copies of the lengths (no device sync to read them)
    k_lens: np.ndarray


def plan_keys(table: torch.Tensor, rows: list[int], starts: list[int], q_lens: list[int],
              tokens_per_block: int) -> KeyPlan:
    """Indices of every key position ``0 .. start + q_len - 1`` of each segment."""
    dev = table.device
    q = np.asarray(q_lens, dtype=np.int64)
    k = np.asarray(starts, dtype=np.int64) + q
    cu_q = np.concatenate([[0], np.cumsum(q)])
    cu_k = np.concatenate([[0], np.cumsum(k)])
    k_lens_t = torch.from_numpy(k).to(dev, non_blocking=False)
    seg_start = torch.repeat_interleave(torch.from_numpy(cu_k[:-1]).to(dev), k_lens_t)
    pos = torch.arange(int(cu_k[-1]), device=dev) - seg_start
    row = torch.repeat_interleave(torch.as_tensor(rows, dtype=torch.int64, device=dev), k_lens_t)
    block = table[row, pos // tokens_per_block].long()
    return KeyPlan(block, pos % tokens_per_block,
                   torch.from_numpy(cu_q.astype(np.int32)).to(dev),
                   torch.from_numpy(cu_k.astype(np.int32)).to(dev), q, k)


def flash_available(device: torch.device, compute_dtype: torch.dtype) -> bool:
    return (device.type == "cuda" and compute_dtype in (torch.float16, torch.bfloat16)
            and hasattr(torch.ops.aten, "_flash_attention_forward"))


class PagedAttention:
    """``attend(pool, q, plan)``: ``q [Tq, Hq, D]`` of the step's segments, in order;
    returns ``[Tq, Hq, D]`` in ``q``'s dtype."""

    def __init__(self, *, kv_heads: int, head_dim: int, kernel: str):
        assert kernel in ("flash", "sdpa"), f"unknown attention kernel {kernel!r}"
        self.H, self.D, self.kernel = kv_heads, head_dim, kernel

    def attend(self, pool: torch.Tensor, q: torch.Tensor, plan: KeyPlan) -> torch.Tensor:
        k = pool[:, 0][plan.block, plan.offset].to(q.dtype)  # [Tk, H, D]
        v = pool[:, 1][plan.block, plan.offset].to(q.dtype)
        if self.kernel == "flash":
            out = torch.ops.aten._flash_attention_forward(
                q.contiguous(), k, v, plan.cu_q, plan.cu_k, int(plan.q_lens.max()), int(plan.k_lens.max()),
                0.0, True, False)[0]
            return out
        return self._sdpa(q, k, v, plan)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: KeyPlan) -> torch.Tensor:
        out = torch.empty_like(q)
        cq = np.concatenate([[0], np.cumsum(plan.q_lens)])
        ck = np.concatenate([[0], np.cumsum(plan.k_lens)])
        ones = [i for i, n in enumerate(plan.q_lens) if n == 1]
        for i, n in enumerate(plan.q_lens):
            if n == 1:
                continue
            a, b, s = int(cq[i]), int(cq[i + 1]), int(plan.k_lens[i])
            qpos = torch.arange(s - n, s, device=q.device)
            mask = torch.arange(s, device=q.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[ck[i]: ck[i + 1]].transpose(0, 1),
                                               v[ck[i]: ck[i + 1]].transpose(0, 1), attn_mask=mask,
                                               enable_gqa=True)
            out[a:b] = o.transpose(0, 1)
        if ones:
            self._decode_batch(q, k, v, out, ones, cq, ck, plan.k_lens)
        return out

    @staticmethod
    def _decode_batch(q, k, v, out, ones, cq, ck, k_lens) -> None:
        """The one-token segments as one padded batch."""
        dev = q.device
        lens = torch.as_tensor(k_lens[ones], device=dev)
        width = int(k_lens[ones].max())
        idx = torch.as_tensor(ck[ones], device=dev)[:, None] + torch.arange(width, device=dev)[None, :]
        mask = torch.arange(width, device=dev)[None, :] < lens[:, None]
        idx = torch.where(mask, idx, 0)
        kb, vb = k[idx].transpose(1, 2), v[idx].transpose(1, 2)  # [B, H, W, D]
        qi = torch.as_tensor(cq[ones], device=dev)
        o = F.scaled_dot_product_attention(q[qi][:, :, None, :], kb, vb, attn_mask=mask[:, None, None, :],
                                           enable_gqa=True)  # [B, Hq, 1, D]
        out[qi] = o[:, :, 0]
