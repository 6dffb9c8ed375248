"""Attention of a step's new tokens over the paged pool, read through the block table.

Every segment (a prefill's new tokens, or one decode token) attends to all of its
sequence's positions before it and to itself (causal, aligned to the end: the last
query sees every key). Each layer gathers the keys and values of the step's segments
out of ``kv_pool(layer)`` block by block (whole 16-token blocks: one 32 KiB row each of
K and of V), so reused blocks are read where the cache put them; a segment's keys are
padded to whole blocks and its used length (``seqused_k``) says where they end.
``plan_keys`` builds the block list once per step. Gathering whole blocks instead of
single positions runs at ~2 TB/s against ~0.36 on the H200 (scripts/gpu/attention_probe.py).

Two kernels:

* ``flash`` (CUDA, 16-bit compute): variable-length FlashAttention
  (``aten._flash_attention_forward``, bottom-right causal, grouped-query heads natively)
  once for the step's multi-token segments and once for its decodes, the decodes with
  their query heads packed as rows of their K/V head (a tile of ``q_per_kv`` rows
  instead of one row per head: 4x fewer thread blocks streaming the same keys);
  with Triton (CUDA builds of torch), the decodes instead read their keys where they lie
  (``paged_decode``: no gather, one kernel and a combine a layer);
* ``sdpa`` (CPU, or any other dtype): ``scaled_dot_product_attention`` per multi-token
  segment with an explicit bottom-right causal mask, and one padded batch for the
  decodes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .paged_decode import paged_decode

__all__ = ["KeyGroup", "KeyPlan", "PagedAttention", "flash_available", "plan_keys"]


@dataclass(slots=True)
class KeyGroup:
    """Segments attended by one kernel call: the multi-token ones or the decodes."""

    q_rows: torch.Tensor | slice  # their queries among the step's
    blocks: torch.Tensor | None  # [nb] pool block of every key block, segment by segment (gathered)
    cu_q: torch.Tensor  # int32 [n + 1] on the device: the segments among the queries
    cu_k: torch.Tensor  # int32 [n + 1]: among the gathered keys (whole blocks)
    used_k: torch.Tensor  # int32 [n]: keys each segment attends (seqused_k)
    q_lens: np.ndarray  # host copies (no device sync to read them)
    k_lens: np.ndarray
    k_starts: np.ndarray  # host copy of cu_k[:-1]
    table: torch.Tensor  # the step's block table (int32 rows)
    table_rows: torch.Tensor | None  # int32 [n] on the device: each segment's row of ``table`` (paged)


@dataclass(slots=True)
class KeyPlan:
    """Where the keys of a step's segments live in the pool."""

    multi: KeyGroup | None  # segments of two or more new tokens (prefills)
    single: KeyGroup | None  # one-token segments (decodes)


def upload(a: np.ndarray, dev: torch.device) -> torch.Tensor:
    """``a`` on ``dev``, queued: the host never waits for the device. A blocking copy
    from pageable memory synchronizes the stream (the host would wait for every kernel
    queued before it: a step's whole forward pass, the next step's copies); a copy from
    pinned memory is queued, the pinned buffer (the caching host allocator's) held by an
    event until the copy ran (rule S3)."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if dev.type != "cuda":
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)


def _rows(idx: np.ndarray, dev: torch.device) -> torch.Tensor | slice:
    if len(idx) and np.array_equal(idx, np.arange(idx[0], idx[0] + len(idx))):
        return slice(int(idx[0]), int(idx[0]) + len(idx))
    return upload(idx, dev)


def _group(table: torch.Tensor, rows: np.ndarray, starts: np.ndarray, q_lens: np.ndarray,
           q_rows: np.ndarray, tokens_per_block: int, paged: bool) -> KeyGroup:
    """``paged``: the kernel reads the table itself (its rows go up), else the key
    blocks are listed for the gather."""
    dev = table.device
    k = starts + q_lens
    nblk = -(-k // tokens_per_block)
    cu_q = np.concatenate([[0], np.cumsum(q_lens)])
    cu_k = np.concatenate([[0], np.cumsum(nblk * tokens_per_block)])
    up = (lambda a: upload(a.astype(np.int32), dev))
    blocks = None
    if not paged:
        r = np.repeat(rows, nblk)
        c = np.arange(int(nblk.sum())) - np.repeat(np.cumsum(nblk) - nblk, nblk)
        blocks = table[upload(r, dev), upload(c, dev)].long()
    return KeyGroup(_rows(q_rows, dev), blocks, up(cu_q), up(cu_k), up(k), q_lens, k, cu_k[:-1], table,
                    up(rows) if paged else None)


def plan_keys(table: torch.Tensor, rows: list[int], starts: list[int], q_lens: list[int],
              tokens_per_block: int, paged_decodes: bool = False) -> KeyPlan:
    """The key blocks of every segment (positions ``0 .. start + q_len - 1`` of table
    row ``rows[i]``), the multi-token segments and the decodes apart; ``paged_decodes``:
    as ``PagedAttention.paged_decodes`` (the decodes' blocks are then not listed)."""
    rows_a = np.asarray(rows, dtype=np.int64)
    s = np.asarray(starts, dtype=np.int64)
    q = np.asarray(q_lens, dtype=np.int64)
    first = np.concatenate([[0], np.cumsum(q)[:-1]])
    groups = []
    for pick, paged in ((q > 1, False), (q == 1, paged_decodes)):
        i = np.flatnonzero(pick)
        if not len(i):
            groups.append(None)
            continue
        q_rows = np.concatenate([np.arange(first[j], first[j] + q[j]) for j in i])
        groups.append(_group(table, rows_a[i], s[i], q[i], q_rows, tokens_per_block, paged))
    return KeyPlan(*groups)


def flash_available(device: torch.device, compute_dtype: torch.dtype) -> bool:
    return (device.type == "cuda" and compute_dtype in (torch.float16, torch.bfloat16)
            and hasattr(torch.ops.aten, "_flash_attention_forward"))


class PagedAttention:
    """``attend(pool, q, plan)``: ``q [Tq, Hq, D]`` of the step's segments, in order;
    returns ``[Tq, Hq, D]`` in ``q``'s dtype. ``paged_decodes``: the decodes read
    their keys where they lie (``paged_decode``, Triton) instead of gathered."""

    def __init__(self, *, kv_heads: int, head_dim: int, kernel: str, paged_decodes: bool = False):
        assert kernel in ("flash", "sdpa"), f"unknown attention kernel {kernel!r}"
        self.H, self.D, self.kernel, self.paged_decodes = kv_heads, head_dim, kernel, paged_decodes

    def describe(self) -> str:
        return self.kernel + (" (decodes: paged Triton kernel)" if self.paged_decodes else "")

    def attend(self, pool: torch.Tensor, q: torch.Tensor, plan: KeyPlan,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """``out``: where to write (``q``'s shape and dtype), else a new tensor."""
        out = torch.empty_like(q) if out is None else out
        for group, one in ((plan.multi, False), (plan.single, True)):
            if group is None:
                continue
            if one and self.paged_decodes:
                self._paged(pool, q, group, out)
                continue
            assert group.blocks is not None, "decodes planned for the paged kernel: plan_keys(paged_decodes=)"
            # Whole blocks: [nb, tokens_per_block, H, D] -> [nb * tokens_per_block, H, D].
            k = pool[:, 0].index_select(0, group.blocks).flatten(0, 1).to(q.dtype)
            v = pool[:, 1].index_select(0, group.blocks).flatten(0, 1).to(q.dtype)
            qg = q[group.q_rows]
            if self.kernel == "flash":
                out[group.q_rows] = self._flash_decodes(qg, k, v, group) if one else \
                    self._flash(qg, k, v, group, group.cu_q, int(group.q_lens.max()), causal=True)
            elif one:
                out[group.q_rows] = self._sdpa_decodes(qg, k, v, group)
            else:
                out[group.q_rows] = self._sdpa(qg, k, v, group)
        return out

    @staticmethod
    def _paged(pool: torch.Tensor, q: torch.Tensor, group: KeyGroup, out: torch.Tensor) -> None:
        """The decodes straight out of the pool, into ``out`` (in place when their rows
        are a range, as the engine orders them: decodes last)."""
        assert group.table_rows is not None, "decodes planned for a gather: plan_keys(paged_decodes=)"
        rows, longest = group.q_rows, int(group.k_lens.max())
        if isinstance(rows, slice):
            paged_decode(q[rows], pool, group.table, group.table_rows, group.used_k, out[rows], longest)
        else:
            qg = q[rows]
            out[rows] = paged_decode(qg, pool, group.table, group.table_rows, group.used_k,
                                     torch.empty_like(qg), longest)

    @staticmethod
    def _flash(q, k, v, group: KeyGroup, cu_q, max_q: int, *, causal: bool) -> torch.Tensor:
        return torch.ops.aten._flash_attention_forward(
            q.contiguous(), k, v, cu_q, group.cu_k, max_q, int(group.k_lens.max()), 0.0, causal, False,
            seqused_k=group.used_k)[0]

    def _flash_decodes(self, q, k, v, group: KeyGroup) -> torch.Tensor:
        """One query per sequence: its ``R`` query heads of a K/V head become ``R``
        rows of that head (query head ``h * R + j`` reads K/V head ``h``), attending
        every key (no mask: all rows sit at the last position)."""
        n, hq, d = q.shape
        r = hq // self.H
        packed = q.view(n, self.H, r, d).transpose(1, 2).reshape(n * r, self.H, d)
        o = self._flash(packed, k, v, group, group.cu_q * r, r, causal=False)
        return o.view(n, r, self.H, d).transpose(1, 2).reshape(n, hq, d)

    @staticmethod
    def _sdpa(q, k, v, group: KeyGroup) -> torch.Tensor:
        out = torch.empty_like(q)
        cq = np.concatenate([[0], np.cumsum(group.q_lens)])
        for i, n in enumerate(group.q_lens):
            a, b, s, k0 = int(cq[i]), int(cq[i + 1]), int(group.k_lens[i]), int(group.k_starts[i])
            qpos = torch.arange(s - n, s, device=q.device)
            mask = torch.arange(s, device=q.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[k0: k0 + s].transpose(0, 1),
                                               v[k0: k0 + s].transpose(0, 1), attn_mask=mask, enable_gqa=True)
            out[a:b] = o.transpose(0, 1)
        return out

    @staticmethod
    def _sdpa_decodes(q, k, v, group: KeyGroup) -> torch.Tensor:
        """The one-token segments as one padded batch."""
        dev = q.device
        lens = upload(group.k_lens, dev)
        width = int(group.k_lens.max())
        idx = upload(group.k_starts, dev)[:, None] + torch.arange(width, device=dev)[None, :]
        mask = torch.arange(width, device=dev)[None, :] < lens[:, None]
        idx = torch.where(mask, idx, 0)
        kb, vb = k[idx].transpose(1, 2), v[idx].transpose(1, 2)  # [B, H, W, D]
        o = F.scaled_dot_product_attention(q[:, :, None, :], kb, vb, attn_mask=mask[:, None, None, :],
                                           enable_gqa=True)  # [B, Hq, 1, D]
        return o[:, :, 0]
