"""Piecewise CUDA graphs of the decoder: a step's per-token work replayed, its
attention run eagerly.

An eager forward pass of Llama-3-8B's 32 layers launches about a thousand kernels, and
at the small steps of a lightly loaded server the host's launching, not the GPU, sets
the step's time (about 30 ms on the H200 whatever the step's size, docs/results.md).
Most of those kernels are per-token work whose shapes depend only on the step's token
count: norms, the QKV projection, rotary positions, the output projection and the MLP.
``StepGraphs`` captures that work once per bucket of token counts (a step of ``T``
tokens runs in the smallest bucket of at least ``T``; the padding rows compute garbage
no real row reads, since every captured op works row by row) as ``layers + 1`` graphs:
graph 0 embeds the tokens, computes the rotations and layer 0's queries and K/V; graph
``l`` finishes layer ``l - 1`` (output projection, MLP, residual) and computes layer
``l``'s queries and K/V; graph ``layers`` finishes the last layer. Between graphs the
model writes the K/V into the paged pool and attends eagerly: those depend on the
step's sequences (block table, key lengths) and on the cache's waits for its copies
(``kv_pool(layer)``, rule S5), which stay on the stream in the order they had.

Graphs work in static buffers (``tok``, ``pos`` in; ``x`` the residual stream; ``h``,
``q``, ``kv`` a layer's normed input, queries and new K/V; ``attn`` attention's output,
written eagerly), shared by every bucket: steps never overlap, so neither do replays.
Only a model whose allreduce is a no-op (one rank) can be captured: with tensor
parallelism the allreduce stages through host memory."""

from __future__ import annotations

from typing import Protocol

import torch

from .parallel import TensorParallel

__all__ = ["DEFAULT_BUCKETS", "LayerPieces", "StepGraphs"]

# Token counts of the captured steps, finer where the GPU's time grows with the tokens (a
# padded row costs what a real one does). Past 1,024 tokens a step is long enough on the
# GPU that the host's launches hide behind it, and padding costs more than graphs save
# (H200, 2026-12-01: 1,822 tokens padded to 1,920 took 72.6 ms against 68.4 eager).
DEFAULT_BUCKETS = (8, 16, *range(32, 257, 32), *range(320, 1025, 64))


class LayerPieces(Protocol):
    """The per-token work of a decoder that graphs capture (``model.Decoder``): the
    embedding, the rotations, a layer's queries and K/V, a layer's tail."""

    device: torch.device
    tp: TensorParallel
    L: int  # layers
    Hq: int  # query heads (this rank's)
    H: int  # K/V heads (this rank's)
    D: int  # head dimension
    cdt: torch.dtype  # compute dtype
    kv_dtype: torch.dtype
    embed: torch.Tensor  # [vocab, hidden]

    @property
    def hidden(self) -> int: ...

    def rotation(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def qkv(self, layer: int, x: torch.Tensor, rot: tuple[torch.Tensor, torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def layer_tail(self, layer: int, x: torch.Tensor, h: torch.Tensor, attn: torch.Tensor
                   ) -> torch.Tensor: ...


class StepGraphs:
    """The captured per-token work of ``model`` for steps of up to ``max(buckets)``
    tokens. ``begin(tok, pos)`` loads a step and replays graph 0; ``layer(l)`` replays
    graph ``l + 1`` once ``attn`` holds layer ``l``'s attention."""

    def __init__(self, model: LayerPieces, buckets: tuple[int, ...] = DEFAULT_BUCKETS):
        assert model.device.type == "cuda", f"CUDA graphs need a CUDA model, not {model.device}"
        assert model.tp.size == 1, "a captured step cannot hold the tensor-parallel allreduce"
        self.m, self.buckets = model, tuple(sorted(buckets))
        n, dev = self.buckets[-1], model.device
        self.tok = torch.zeros(n, dtype=torch.long, device=dev)
        self.pos = torch.zeros(n, dtype=torch.long, device=dev)
        self.x = torch.zeros(n, model.hidden, dtype=torch.float32, device=dev)
        self.h = torch.zeros(n, model.hidden, dtype=model.cdt, device=dev)
        self.q = torch.zeros(n, model.Hq, model.D, dtype=model.cdt, device=dev)
        self.kv = torch.zeros(n, 2, model.H, model.D, dtype=model.kv_dtype, device=dev)
        self.attn = torch.zeros(n, model.Hq, model.D, dtype=model.cdt, device=dev)
        self.cos = torch.zeros(n, 1, model.D, dtype=torch.float32, device=dev)
        self.sin = torch.zeros(n, 1, model.D, dtype=torch.float32, device=dev)
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self._n = 0  # the bucket of the step being run

    # -- capture ---------------------------------------------------------------------------------
    def _piece(self, n: int, i: int) -> None:
        """Graph ``i``'s work on the first ``n`` rows of the buffers."""
        m = self.m
        x, h, attn = self.x[:n], self.h[:n], self.attn[:n]
        if i == 0:
            x.copy_(m.embed[self.tok[:n]])
            cos, sin = m.rotation(self.pos[:n])
            self.cos[:n].copy_(cos)
            self.sin[:n].copy_(sin)
        else:
            x.copy_(m.layer_tail(i - 1, x, h, attn.reshape(n, -1)))
        if i < m.L:
            hh, q, kv = m.qkv(i, x, (self.cos[:n], self.sin[:n]))
            h.copy_(hh)
            self.q[:n].copy_(q)
            self.kv[:n].copy_(kv)

    def capture(self) -> None:
        """Capture every bucket (a few seconds for Llama-3-8B): before any timed step."""
        for n in self.buckets:
            if n in self._graphs:
                continue
            side = torch.cuda.Stream(self.m.device)
            side.wait_stream(torch.cuda.current_stream(self.m.device))
            with torch.cuda.stream(side):  # warm-up: libraries pick their algorithms off the graph
                for i in range(self.m.L + 1):
                    self._piece(n, i)
            torch.cuda.current_stream(self.m.device).wait_stream(side)
            graphs = []
            for i in range(self.m.L + 1):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local"):
                    self._piece(n, i)
                graphs.append(g)
            self._graphs[n] = graphs

    # -- replay ----------------------------------------------------------------------------------
    def fits(self, tokens: int) -> bool:
        return tokens <= self.buckets[-1]

    def begin(self, tok: torch.Tensor, pos: torch.Tensor) -> None:
        """Load a step's tokens and positions (``fits``), then embed them and compute
        layer 0's queries and K/V."""
        t = len(tok)
        self._n = next(b for b in self.buckets if b >= t)
        assert self._n in self._graphs, f"bucket {self._n} was not captured (call capture() first)"
        self.tok[:t].copy_(tok, non_blocking=True)
        self.pos[:t].copy_(pos, non_blocking=True)
        self._graphs[self._n][0].replay()

    def layer(self, layer: int) -> None:
        """Layer ``layer``'s attention is in ``attn``: finish the layer and compute the
        next one's queries and K/V (after the last, ``x`` is the final residual)."""
        self._graphs[self._n][layer + 1].replay()
