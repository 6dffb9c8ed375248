"""A tiny tensor-parallel decoder with random seeded weights: real K/V for the cache.

Every layer is a parallel block (``x + attention(norm(x)) + mlp(norm(x))``) with
rotary positions. The global model has ``model.num_kv_heads × world size`` heads;
its weights are drawn from the seed on every rank and each rank keeps the slice of
its own heads (and of the MLP), Megatron style, so a rank's cache holds exactly its
heads' K/V. A layer's partial outputs are summed over the ranks with one allreduce.

Compute is float32; K/V are stored in the cache's dtype and attention reads them back
from ``kv_pool`` through ``block_table`` — the reference recompute rounds K/V the same
way, so both paths see identical K/V inputs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .parallel import TensorParallel


@dataclass(slots=True)
class Segment:
    """New tokens of one sequence in a step: they sit at positions ``start ..`` and
    the sequence's row of the block table covers every position before them too."""

    row: int
    start: int
    tokens: np.ndarray

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class TinyModel:
    """``layers`` decoder layers over ``heads`` K/V heads of this rank (MHA)."""

    def __init__(self, *, layers: int, heads: int, head_dim: int, hidden: int, vocab: int,
                 seed: int, tp: TensorParallel, device: torch.device, kv_dtype: torch.dtype,
                 tokens_per_block: int):
        self.L, self.H, self.D = layers, heads, head_dim
        self.tp, self.device, self.kv_dtype = tp, device, kv_dtype
        self.tpb = tokens_per_block
        total_heads = heads * tp.size
        mine = slice(tp.rank * heads, (tp.rank + 1) * heads)
        ffn = 4 * hidden
        ffn_mine = np.array_split(np.arange(ffn), tp.size)[tp.rank]
        f_lo, f_hi = int(ffn_mine[0]), int(ffn_mine[-1]) + 1
        g = torch.Generator().manual_seed(seed)

        def randn(*shape: int, fan_in: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / fan_in**0.5

        # Drawn at global size on every rank, so every rank slices one and the same model.
        self.embed = torch.randn(vocab, hidden, generator=g).to(device)
        self.wqkv, self.wo, self.w1, self.w2 = [], [], [], []
        for _ in range(layers):
            qkv = randn(hidden, 3, total_heads, head_dim, fan_in=hidden)[:, :, mine]
            wo = randn(total_heads, head_dim, hidden, fan_in=total_heads * head_dim)[mine]
            w1 = randn(hidden, ffn, fan_in=hidden)[:, f_lo:f_hi]
            w2 = randn(ffn, hidden, fan_in=ffn)[f_lo:f_hi]
            self.wqkv.append(qkv.reshape(hidden, 3 * heads * head_dim).contiguous().to(device))
            self.wo.append(wo.reshape(heads * head_dim, hidden).contiguous().to(device))
            self.w1.append(w1.contiguous().to(device))
            self.w2.append(w2.contiguous().to(device))
        half = head_dim // 2
        self._inv_freq = (1.0 / 10000 ** (torch.arange(half, dtype=torch.float64) / max(half, 1))
                          ).to(torch.float32).to(device)

    # -- pieces ---------------------------------------------------------------------------------
    def _rotation(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, D/2]`` of the positions ``pos [T]``, once per forward pass."""
        ang = pos.to(torch.float32)[:, None] * self._inv_freq[None, :]
        return ang.cos()[:, None, :], ang.sin()[:, None, :]

    def _rope(self, x: torch.Tensor, rot: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate ``x [T, H, D]`` by ``rot`` (``_rotation``; half-split pairs)."""
        half = self.D // 2
        if half == 0:
            return x
        cos, sin = rot
        a, b = x[..., :half], x[..., half: 2 * half]
        out = x.clone()
        out[..., :half] = a * cos - b * sin
        out[..., half: 2 * half] = a * sin + b * cos
        return out

    def _layer_tail(self, layer: int, x: torch.Tensor, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        part = attn @ self.wo[layer] + F.gelu(h @ self.w1[layer]) @ self.w2[layer]
        self.tp.allreduce_(part)
        return x + part

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x) @ self.embed.T

    # -- the serving path: K/V through the cache ------------------------------------------------
    def forward_cached(self, cache, table: torch.Tensor, segs: list[Segment]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute the segments' new tokens against the cache: write their K/V through
        ``table`` into ``cache.kv_pool(layer)`` and attend over every cached position.
        Returns the logits of each segment's last token ``[len(segs), vocab]`` and the
        K/V written ``[T, layers, 2, heads, head_dim]`` in the cache's dtype."""
        dev, tpb = self.device, self.tpb
        lens = [len(s.tokens) for s in segs]
        tok = torch.from_numpy(np.concatenate([s.tokens for s in segs]).astype(np.int64)).to(dev)
        pos = torch.cat([torch.arange(s.start, s.end) for s in segs]).to(dev)
        rows = torch.repeat_interleave(torch.tensor([s.row for s in segs]), torch.tensor(lens)).to(dev)
        blk = table[rows, pos // tpb].long()
        off = pos % tpb
        starts = np.concatenate([[0], np.cumsum(lens)])
        decodes = [i for i, s in enumerate(segs) if len(s.tokens) == 1]
        prefills = [i for i, s in enumerate(segs) if len(s.tokens) > 1]
        plan = self._decode_plan(table, segs, decodes, starts)
        written = torch.empty((len(tok), self.L, 2, self.H, self.D), dtype=self.kv_dtype, device=dev)
        x = self.embed[tok]
        rot = self._rotation(pos)
        for layer in range(self.L):
            h = _rms_norm(x)
            qkv = (h @ self.wqkv[layer]).view(-1, 3, self.H, self.D)
            q, k = self._rope(qkv[:, 0], rot), self._rope(qkv[:, 1], rot)
            kv = torch.stack([k, qkv[:, 2]], dim=1).to(self.kv_dtype)
            pool = cache.kv_pool(layer)
            pool[blk, :, off] = kv
            written[:, layer] = kv
            attn = torch.empty((len(tok), self.H, self.D), dtype=torch.float32, device=dev)
            for i in prefills:
                a, b = starts[i], starts[i + 1]
                attn[a:b] = self._attend_one(pool, table[segs[i].row], q[a:b], segs[i])
            if decodes:
                attn[plan[0]] = self._attend_decodes(pool, q[plan[0]], plan)
            x = self._layer_tail(layer, x, h, attn.view(len(tok), -1))
        return self._logits(x[torch.as_tensor(starts[1:] - 1, device=dev)]), written

    def _attend_one(self, pool: torch.Tensor, row: torch.Tensor, q: torch.Tensor,
                    seg: Segment) -> torch.Tensor:
        n_blocks = -(-seg.end // self.tpb)
        kv = pool[row[:n_blocks].long()]  # [blocks, 2, tpb, H, D]
        k = kv[:, 0].reshape(-1, self.H, self.D)[: seg.end].to(torch.float32)
        v = kv[:, 1].reshape(-1, self.H, self.D)[: seg.end].to(torch.float32)
        qpos = torch.arange(seg.start, seg.end, device=q.device)
        mask = torch.arange(seg.end, device=q.device)[None, :] <= qpos[:, None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             attn_mask=mask)
        return out.transpose(0, 1)

    def _decode_plan(self, table: torch.Tensor, segs: list[Segment], decodes: list[int],
                     starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token indices, padded block rows and key masks of the one-token segments,
        attended as one batch."""
        if not decodes:
            return (torch.empty(0),) * 3
        dev = self.device
        ends = torch.tensor([segs[i].end for i in decodes], device=dev)
        width = -(-int(ends.max()) // self.tpb)
        rows = table[torch.tensor([segs[i].row for i in decodes], device=dev), :width].long().clamp(min=0)
        mask = torch.arange(width * self.tpb, device=dev)[None, :] < ends[:, None]
        return torch.as_tensor(starts[decodes], device=dev), rows, mask[:, None, None, :]

    def _attend_decodes(self, pool: torch.Tensor, q: torch.Tensor, plan) -> torch.Tensor:
        _, rows, mask = plan
        kv = pool[rows]  # [B, width, 2, tpb, H, D]
        b = rows.shape[0]
        k = kv[:, :, 0].reshape(b, -1, self.H, self.D).to(torch.float32).transpose(1, 2)
        v = kv[:, :, 1].reshape(b, -1, self.H, self.D).to(torch.float32).transpose(1, 2)
        out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask)  # [B, H, 1, D]
        return out[:, :, 0]

    # -- the reference: a from-scratch recompute without the cache -------------------------------
    def forward_dense(self, tokens: np.ndarray) -> torch.Tensor:
        """Logits of the last token of ``tokens``, computed from scratch (collective)."""
        dev = self.device
        tok = torch.from_numpy(np.asarray(tokens, dtype=np.int64)).to(dev)
        pos = torch.arange(len(tok), device=dev)
        x = self.embed[tok]
        rot = self._rotation(pos)
        for layer in range(self.L):
            h = _rms_norm(x)
            qkv = (h @ self.wqkv[layer]).view(-1, 3, self.H, self.D)
            q, k = self._rope(qkv[:, 0], rot), self._rope(qkv[:, 1], rot)
            # Round K/V through the cache dtype exactly as the cached path stores them.
            k = k.to(self.kv_dtype).to(torch.float32)
            v = qkv[:, 2].to(self.kv_dtype).to(torch.float32)
            out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                 is_causal=True)
            x = self._layer_tail(layer, x, h, out.transpose(0, 1).reshape(len(tok), -1))
        return self._logits(x[-1:])[0]
