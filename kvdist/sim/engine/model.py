"""The simulation's tensor-parallel decoder with random seeded weights: real K/V for
the cache, and on the GPU the real cost of a prefill.

The geometry is the config's (``Geometry.from_config``): ``model.num_layers`` layers,
``model.num_kv_heads`` K/V heads per rank of ``model.head_dim``, ``workload.q_per_kv``
query heads per K/V head (grouped-query attention), ``workload.hidden`` wide, a
SwiGLU MLP of ``workload.ffn_hidden`` (split over the ranks), ``workload.vocab_size``
tokens. configs/h200.yaml is Llama-3-8B's geometry; configs/default.yaml a tiny one.
Every layer is a parallel block (``x + attention(norm(x)) + mlp(norm(x))``: one
allreduce per layer) with rotary positions. The weights are drawn at global size from
the seed on the model's device, and each rank keeps the slice of its own heads and of
the MLP (Megatron style), so a rank's cache holds exactly its heads' K/V.

Matmuls run in the compute dtype (float32 on CPU, bfloat16 on CUDA by default), the
residual stream in float32. K/V are stored in the cache's dtype and attention reads
them back from ``kv_pool`` through ``block_table`` (``attention``); the reference
recompute rounds K/V the same way, so both paths see identical K/V inputs."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ...config import CacheConfig
from .attention import PagedAttention, flash_available, plan_keys, upload
from .graphs import DEFAULT_BUCKETS, StepGraphs
from .paged_decode import available as paged_available
from .parallel import TensorParallel

log = logging.getLogger("kvdist.sim")


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


@dataclass(frozen=True, slots=True)
class Geometry:
    layers: int
    kv_heads: int  # per rank
    head_dim: int
    q_per_kv: int
    hidden: int
    ffn: int  # global; split over the ranks
    vocab: int

    @classmethod
    def from_config(cls, cfg: CacheConfig) -> Geometry:
        m, w = cfg.model, cfg.workload
        return cls(m.num_layers, m.num_kv_heads, m.head_dim, w.q_per_kv, w.hidden,
                   w.ffn_hidden or 4 * w.hidden, w.vocab_size)

    def params(self, ranks: int) -> int:
        """Weights of the global model (the embedding doubles as the output head)."""
        qkv = self.hidden * (self.q_per_kv + 2) * self.kv_heads * ranks * self.head_dim
        wo = self.q_per_kv * self.kv_heads * ranks * self.head_dim * self.hidden
        return self.layers * (qkv + wo + 3 * self.hidden * self.ffn) + self.vocab * self.hidden

    def describe(self, ranks: int) -> str:
        kv = self.kv_heads * ranks
        return (f"{self.layers} layers, {self.q_per_kv * kv} query / {kv} K/V heads "
                f"({self.kv_heads} per rank) x {self.head_dim}, hidden {self.hidden}, MLP {self.ffn}, "
                f"vocab {self.vocab}; {_count(self.params(ranks))} parameters")


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), eps=1e-6)


def compute_dtype_for(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


class Decoder:
    """The rank's part of the model; ``forward_cached`` is the serving path."""

    def __init__(self, g: Geometry, *, seed: int, tp: TensorParallel, device: torch.device,
                 kv_dtype: torch.dtype, compute_dtype: torch.dtype, tokens_per_block: int):
        self.g, self.L, self.H, self.D = g, g.layers, g.kv_heads, g.head_dim
        self.Hq = g.q_per_kv * g.kv_heads
        self.tp, self.device, self.kv_dtype, self.cdt = tp, device, kv_dtype, compute_dtype
        self.tpb = tokens_per_block
        kernel = "flash" if flash_available(device, compute_dtype) else "sdpa"
        self.attention = PagedAttention(kv_heads=self.H, head_dim=self.D, kernel=kernel,
                                        paged_decodes=kernel == "flash" and paged_available(device))
        H, D, r = self.H, self.D, tp.rank
        total_kv = H * tp.size
        ffn_mine = np.array_split(np.arange(g.ffn), tp.size)[tp.rank]
        f_lo, f_hi = int(ffn_mine[0]), int(ffn_mine[-1]) + 1
        gen = torch.Generator(device=device).manual_seed(seed)

        def randn(*shape: int, fan_in: int) -> torch.Tensor:
            # Drawn at global size on every rank (same seed, same device type), scaled in place.
            return torch.randn(*shape, generator=gen, device=device, dtype=compute_dtype).mul_(fan_in**-0.5)

        self.embed = randn(g.vocab, g.hidden, fan_in=1)
        self.wqkv, self.wo, self.w13, self.w2 = [], [], [], []
        for _ in range(g.layers):
            q = randn(g.hidden, total_kv * g.q_per_kv, D, fan_in=g.hidden)[:, r * self.Hq:(r + 1) * self.Hq]
            kv = randn(g.hidden, 2, total_kv, D, fan_in=g.hidden)[:, :, r * H:(r + 1) * H]
            self.wqkv.append(torch.cat([q.reshape(g.hidden, -1), kv.reshape(g.hidden, -1)], 1).contiguous())
            wo = randn(total_kv * g.q_per_kv, D, g.hidden, fan_in=total_kv * g.q_per_kv * D)
            self.wo.append(wo[r * self.Hq:(r + 1) * self.Hq].reshape(-1, g.hidden).contiguous())
            w13 = randn(g.hidden, 2, g.ffn, fan_in=g.hidden)[:, :, f_lo:f_hi]
            self.w13.append(w13.reshape(g.hidden, -1).contiguous())
            self.w2.append(randn(g.ffn, g.hidden, fan_in=g.ffn)[f_lo:f_hi].contiguous())
        half = D // 2
        self._inv_freq = (1.0 / 10000 ** (torch.arange(half, dtype=torch.float64) / max(half, 1))
                          ).to(torch.float32).to(device)
        self.graphs: StepGraphs | None = None  # capture_graphs()

    @property
    def hidden(self) -> int:
        return self.g.hidden

    def can_capture(self) -> bool:
        """Whether steps can replay CUDA graphs (``graphs``): a CUDA model on one rank."""
        return self.device.type == "cuda" and self.tp.size == 1

    def capture_graphs(self, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> None:
        """From now on a step of at most ``max(buckets)`` tokens replays its per-token
        work from CUDA graphs (``graphs``: attention stays eager); ``can_capture`` first."""
        assert self.can_capture(), f"no CUDA graphs on {self.device} with {self.tp.size} ranks"
        graphs = StepGraphs(self, buckets)
        graphs.capture()
        self.graphs = graphs

    # -- pieces ---------------------------------------------------------------------------------
    def rotation(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-width cos and ``[-sin, sin]`` ``[T, 1, D]`` of the positions ``pos [T]``
        (half-split pairs; an odd last dimension stays as it is), once per forward pass."""
        ang = pos.to(torch.float32)[:, None] * self._inv_freq[None, :]
        cos, sin = ang.cos(), ang.sin()
        odd = torch.ones(len(pos), self.D % 2, device=pos.device)
        return (torch.cat([cos, cos, odd], -1)[:, None, :],
                torch.cat([-sin, sin, odd * 0], -1)[:, None, :])

    def _rope(self, x: torch.Tensor, rot: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate ``x [T, H, D]`` by ``rot`` (``_rotation``) in float32: pair ``(a, b)``
        of dims ``(i, i + D/2)`` becomes ``(a cos - b sin, a sin + b cos)``. A handful
        of kernels for any number of heads: a step's queries and keys go together."""
        half = self.D // 2
        x = x.to(torch.float32)
        cos, sin = rot
        swapped = torch.cat([x[..., half: 2 * half], x[..., :half], x[..., 2 * half:]], -1)
        return torch.addcmul(x * cos, swapped, sin)

    def qkv(self, layer: int, x: torch.Tensor, rot) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed input ``h``, queries ``[T, Hq, D]`` (compute dtype) and the new K/V
        ``[T, 2, H, D]`` in the cache's dtype."""
        h = _rms_norm(x).to(self.cdt)
        qkv = h @ self.wqkv[layer]
        T, nq, nk = len(x), self.Hq * self.D, self.H * self.D
        qk = self._rope(qkv[:, : nq + nk].view(T, self.Hq + self.H, self.D), rot)
        v = qkv[:, nq + nk:].view(T, self.H, self.D)
        kv = torch.stack([qk[:, self.Hq:].to(self.kv_dtype), v.to(self.kv_dtype)], dim=1)
        return h, qk[:, : self.Hq].to(self.cdt), kv

    def layer_tail(self, layer: int, x: torch.Tensor, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        gate, up = (h @ self.w13[layer]).chunk(2, dim=-1)
        part = (attn.to(self.cdt) @ self.wo[layer] + (F.silu(gate) * up) @ self.w2[layer]).to(torch.float32)
        self.tp.allreduce_(part)
        return x + part

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return (_rms_norm(x).to(self.cdt) @ self.embed.T).to(torch.float32)

    # -- the serving path: K/V through the cache ------------------------------------------------
    def forward_cached(self, cache, table: torch.Tensor, segs: list[Segment]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute the segments' new tokens against the cache: write their K/V through
        ``table`` into ``cache.kv_pool(layer)`` and attend over every cached position.
        Returns the logits of each segment's last token ``[len(segs), vocab]`` (float32)
        and the K/V written ``[T, layers, 2, heads, head_dim]`` in the cache's dtype."""
        dev, tpb = self.device, self.tpb
        lens = [len(s.tokens) for s in segs]
        tok_a = np.concatenate([s.tokens for s in segs]).astype(np.int64)
        pos_a = np.concatenate([np.arange(s.start, s.end) for s in segs])
        tok, pos = torch.from_numpy(tok_a), torch.from_numpy(pos_a)
        T = len(tok)
        graphs = self.graphs if self.graphs is not None and self.graphs.fits(T) else None
        if graphs is not None:  # embeds, rotates and computes layer 0's queries and K/V
            graphs.begin(tok, pos)
            pos = graphs.pos[:T]
        else:
            tok, pos = upload(tok_a, dev), upload(pos_a, dev)
            x = self.embed[tok].to(torch.float32)
            rot = self.rotation(pos)
        # No upload waits for the device: the host queues the whole pass and goes on.
        rows = upload(np.repeat(np.array([s.row for s in segs], dtype=np.int64), lens), dev)
        blk = table[rows, pos // tpb].long()
        off = pos % tpb
        keys = plan_keys(table, [s.row for s in segs], [s.start for s in segs], lens, tpb,
                         paged_decodes=self.attention.paged_decodes)
        written = torch.empty((T, self.L, 2, self.H, self.D), dtype=self.kv_dtype, device=dev)
        for layer in range(self.L):
            if graphs is not None:
                q, kv = graphs.q[:T], graphs.kv[:T]
            else:
                h, q, kv = self.qkv(layer, x, rot)
            pool = cache.kv_pool(layer)
            pool[blk, :, off] = kv
            written[:, layer] = kv
            if graphs is not None:
                self._attend(pool, q, keys, out=graphs.attn[:T])
                graphs.layer(layer)  # the layer's tail and the next one's queries and K/V
            else:
                attn = self._attend(pool, q, keys)
                x = self.layer_tail(layer, x, h, attn.reshape(T, -1))
        if graphs is not None:
            x = graphs.x[:T]
        ends = upload(np.cumsum(lens) - 1, dev)
        return self._logits(x[ends]), written

    def _attend(self, pool: torch.Tensor, q: torch.Tensor, keys, out: torch.Tensor | None = None
                ) -> torch.Tensor:
        try:
            return self.attention.attend(pool, q, keys, out)
        except RuntimeError as e:  # a build without the varlen flash kernel: say so once
            if self.attention.kernel != "flash":
                raise
            log.warning("flash attention failed (%s); using scaled_dot_product_attention", e)
            self.attention.kernel = "sdpa"
            return self.attention.attend(pool, q, keys, out)

    # -- the reference: a from-scratch recompute without the cache -------------------------------
    def forward_dense(self, tokens: np.ndarray) -> torch.Tensor:
        """Logits of the last token of ``tokens``, computed from scratch (collective)."""
        dev = self.device
        tok = torch.from_numpy(np.asarray(tokens, dtype=np.int64)).to(dev)
        pos = torch.arange(len(tok), device=dev)
        x = self.embed[tok].to(torch.float32)
        rot = self.rotation(pos)
        for layer in range(self.L):
            h, q, kv = self.qkv(layer, x, rot)
            # K/V rounded through the cache dtype exactly as the cached path stores them.
            k, v = (kv[:, i].to(self.cdt).transpose(0, 1) for i in (0, 1))
            out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True, enable_gqa=True)
            x = self.layer_tail(layer, x, h, out.transpose(0, 1).reshape(len(tok), -1))
        return self._logits(x[-1:])[0]


def _count(n: int) -> str:
    """7.50 B, 0.23 M, 640: a parameter count as a reader takes it in."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)
