"""Decode attention read straight out of the paged pool (a Triton kernel).

A step's decodes each attend one query token to the whole context of their sequence.
Gathering that context out of the pool first (``attention``'s whole-block
``index_select``) writes and reads every key twice more than attention needs, a cost
per step of every running sequence's whole context that no reuse shrinks; and it is
a handful of host launches per layer. Here one kernel reads each key and value once,
where the block table says it lies, and a second combines the pieces:

* ``_partials``, a program per (decode, K/V head, chunk of ``CHUNK`` keys): the
  ``q_per_kv`` query heads of that K/V head as the rows of one tile (padded to 16 for
  the tensor cores), an online softmax over the chunk's keys ``BLOCK_N`` at a time,
  each key's block looked up in the decode's row of the block table; it writes the
  chunk's normalized output and log-sum-exp;
* ``_combine``, a program per (decode, K/V head): the chunks' outputs weighted by
  their share of the softmax (split-K, as FlashDecoding does), so that a few long
  sequences still spread over every SM.

Triton is optional (CUDA builds of torch bring it); ``available`` says whether it can
run here. ``TRITON_INTERPRET=1`` runs the kernels on the CPU (tests)."""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch: the gather path serves decodes
    triton = None

__all__ = ["CHUNK", "available", "paged_decode"]

CHUNK = 256  # keys per program of _partials
_BLOCK_N = 64  # keys per iteration
_ROWS = 16  # query rows of a tile (tensor-core minimum)


def available(device: torch.device) -> bool:
    """Whether ``paged_decode`` runs on ``device``: Triton on CUDA, or its interpreter."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    @triton.jit
    def _partials(Q, K, V, Table, Rows, Lens, MidO, MidL, sq_n, sq_h, sk_b, sk_t, sk_h, st_r,
                  so_n, so_h, so_s, so_r, sl_n, sl_h, sl_s, scale,
                  CHUNK: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, D: tl.constexpr,
                  TPB: tl.constexpr, BLOCK_N: tl.constexpr):
        n, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        length = tl.load(Lens + n)
        row = tl.load(Rows + n).to(tl.int64)
        start = s * CHUNK
        end = tl.minimum(start + CHUNK, length)
        r, d = tl.arange(0, RP), tl.arange(0, D)
        q = tl.load(Q + n * sq_n + (h * R + r)[:, None] * sq_h + d[None, :], mask=(r < R)[:, None], other=0.0)
        m = tl.full([RP], float("-inf"), tl.float32)
        total = tl.zeros([RP], tl.float32)
        acc = tl.zeros([RP, D], tl.float32)
        for j in range(0, CHUNK, BLOCK_N):  # a fixed trip count: past ``end`` every key is masked
            t = start + j + tl.arange(0, BLOCK_N)
            live = t < end
            block = tl.load(Table + row * st_r + t // TPB, mask=live, other=0).to(tl.int64)
            at = block[:, None] * sk_b + (t % TPB)[:, None] * sk_t + h * sk_h + d[None, :]
            k = tl.load(K + at, mask=live[:, None], other=0.0).to(q.dtype)
            qk = tl.dot(q, tl.trans(k)) * scale
            qk = tl.where(live[None, :], qk, float("-inf"))
            m_new = tl.maximum(m, tl.max(qk, 1))
            base = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: every weight 0, no NaN
            p = tl.exp(qk - base[:, None])
            alpha = tl.exp(m - base)
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(V + at, mask=live[:, None], other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        some = total > 0  # a chunk past the sequence's end: weight 0 in _combine
        safe = tl.where(some, total, 1.0)
        lse = tl.where(some, m + tl.log(safe), float("-inf"))
        rows = r < R
        tl.store(MidO + n * so_n + h * so_h + s * so_s + r[:, None] * so_r + d[None, :], acc / safe[:, None],
                 mask=rows[:, None])
        tl.store(MidL + n * sl_n + h * sl_h + s * sl_s + r, lse, mask=rows)

    @triton.jit
    def _combine(MidO, MidL, Out, S, so_n, so_h, so_s, so_r, sl_n, sl_h, sl_s, sout_n, sout_h,
                 R: tl.constexpr, RP: tl.constexpr, D: tl.constexpr):
        n, h = tl.program_id(0), tl.program_id(1)
        r, d = tl.arange(0, RP), tl.arange(0, D)
        rows = r < R
        # Chunk 0 always holds keys (a decode attends at least itself): m is finite after it.
        m = tl.full([RP], float("-inf"), tl.float32)
        total = tl.zeros([RP], tl.float32)
        acc = tl.zeros([RP, D], tl.float32)
        for s in range(0, S):
            lse = tl.load(MidL + n * sl_n + h * sl_h + s * sl_s + r, mask=rows, other=0.0)
            o = tl.load(MidO + n * so_n + h * so_h + s * so_s + r[:, None] * so_r + d[None, :],
                        mask=rows[:, None], other=0.0)
            m_new = tl.maximum(m, lse)
            alpha = tl.exp(m - m_new)
            w = tl.exp(lse - m_new)
            acc = acc * alpha[:, None] + o * w[:, None]
            total = total * alpha + w
            m = m_new
        out = acc / total[:, None]
        tl.store(Out + n * sout_n + (h * R + r)[:, None] * sout_h + d[None, :],
                 out.to(Out.dtype.element_ty), mask=rows[:, None])


def paged_decode(q: torch.Tensor, pool: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                 lens: torch.Tensor, out: torch.Tensor, max_len: int) -> torch.Tensor:
    """Attention of ``q [N, Hq, D]`` (one query a decode) over the first ``lens[i]``
    positions of table row ``rows[i]``, read out of ``pool [blocks, 2, tokens_per_block,
    H, D]`` (K at index 0 of dim 1); written into ``out [N, Hq, D]`` (any row stride),
    which is returned. ``max_len``: ``lens.max()`` (known on the host: no sync)."""
    n, hq, dim = q.shape
    heads, tpb = pool.shape[3], pool.shape[2]
    r = hq // heads
    assert r <= _ROWS and q.stride(2) == 1 and out.stride(2) == 1 and pool.stride(4) == 1, \
        "paged_decode: unsupported layout"
    assert table.dtype == torch.int32 and table.stride(1) == 1, "paged_decode: the table must be int32 rows"
    splits = max(1, -(-max_len // CHUNK))
    mid_o = torch.empty((n, heads, splits, _ROWS, dim), dtype=torch.float32, device=q.device)
    mid_l = torch.empty((n, heads, splits, _ROWS), dtype=torch.float32, device=q.device)
    k, v = pool[:, 0], pool[:, 1]
    _partials[(n, heads, splits)](
        q, k, v, table, rows, lens, mid_o, mid_l, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        k.stride(2), table.stride(0), *mid_o.stride()[:4], *mid_l.stride()[:3], dim ** -0.5,
        CHUNK=CHUNK, R=r, RP=_ROWS, D=dim, TPB=tpb, BLOCK_N=_BLOCK_N)
    _combine[(n, heads)](mid_o, mid_l, out, splits, *mid_o.stride()[:4], *mid_l.stride()[:3],
                         out.stride(0), out.stride(1), R=r, RP=_ROWS, D=dim)
    return out
