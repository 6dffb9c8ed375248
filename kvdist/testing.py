"""An integrity driver: plays the forward pass against a cache and checks every reused
token's bytes.

The K/V the driver writes at position ``p`` of a sequence is a pattern derived from a
rolling hash of ``tokens[: p + 1]``, the layer and K-or-V, so two sequences agree on
a position exactly when they share the prefix up to it: what a real model gives.
When a prompt reuses cached tokens, the driver reads those positions through
``block_table`` from ``kv_pool`` and compares them with the pattern, bit for bit."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

_MOD = (1 << 61) - 1


def prefix_fingerprints(tokens: Sequence[int], start: int = 0, state: int = 0) -> list[int]:
    """Rolling hash after each token (``state`` is the value before ``tokens[start]``)."""
    out = []
    h = state
    for t in tokens[start:]:
        h = (h * 1000003 + int(t) + 1) % _MOD
        out.append(h)
    return out


@dataclass(slots=True)
class _Track:
    tokens: list[int]
    fingerprints: list[int] = field(default_factory=list)
    write_from: int = 0  # positions [write_from, len) are computed in this step
    check_upto: int = 0  # positions [0, check_upto) were reused in this step


class IntegrityDriver:
    """Drives ``cache`` like an engine's forward pass; counts mismatching tokens."""

    def __init__(self, cache):
        self.cache = cache
        lay = cache.layout
        self.layers, self.heads, self.dim = lay.num_layers, lay.num_kv_heads, lay.head_dim
        self.tpb = lay.tokens_per_block
        self.dtype = cache.kv_pool(0).dtype
        self.seqs: dict[Hashable, _Track] = {}
        self._touched: list[Hashable] = []
        self.mismatched_tokens = 0
        self.checked_tokens = 0
        self.reused_tokens = 0
        self.first_mismatch: str | None = None
        # The per-element offsets of the pattern, [layer, kv, head, dim].
        L, H, D = self.layers, self.heads, self.dim
        self._offsets = (torch.arange(L).view(L, 1, 1, 1) * 13 + torch.arange(2).view(1, 2, 1, 1) * 7
                         + torch.arange(H).view(1, 1, H, 1) * 3 + torch.arange(D).view(1, 1, 1, D))

    def expected(self, fingerprints: list[int]) -> torch.Tensor:
        """``[n, layer, kv, head, dim]`` values in the cache's dtype, on its device."""
        base = torch.tensor([f % 10007 for f in fingerprints], dtype=torch.int64).view(-1, 1, 1, 1, 1)
        vals = (base + self._offsets) % 2039  # integers exact in fp16
        return vals.to(torch.float32).to(self.dtype).to(self.cache.device)

    # -- the step, as an engine drives it -------------------------------------------------
    def begin(self) -> None:
        self.cache.begin_step()
        self._touched = []

    def add(self, seq_id: Hashable, tokens: Sequence[int], priority: int = 35) -> int:
        reused = self.cache.add_sequence(seq_id, tokens, priority)
        tr = _Track(list(tokens))
        tr.fingerprints = prefix_fingerprints(tr.tokens)
        tr.write_from = reused
        tr.check_upto = reused
        self.seqs[seq_id] = tr
        self._touched.append(seq_id)
        self.reused_tokens += reused
        return reused

    def append(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        self.cache.append_tokens(seq_id, tokens)
        tr = self.seqs[seq_id]
        state = tr.fingerprints[-1] if tr.fingerprints else 0
        tr.write_from = len(tr.tokens)
        tr.check_upto = 0
        tr.tokens.extend(tokens)
        tr.fingerprints.extend(prefix_fingerprints(tokens, 0, state))
        self._touched.append(seq_id)

    def compute(self) -> torch.Tensor:
        """block_table, then check reused positions and write the new ones."""
        ids = list(dict.fromkeys(self._touched))
        table = self.cache.block_table(ids)
        for row, seq_id in enumerate(ids):
            tr = self.seqs[seq_id]
            if tr.check_upto:
                self._check(seq_id, table[row], tr)
            self._write(table[row], tr, tr.write_from, len(tr.tokens))
            tr.check_upto = 0
        return table

    def end(self) -> None:
        self.cache.end_step()

    def release(self, seq_id: Hashable) -> None:
        self.cache.release(seq_id)
        del self.seqs[seq_id]

    # -- memory access through the table --------------------------------------------------------
    def _where(self, table_row: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(lo, hi, device=table_row.device)
        return table_row[pos // self.tpb].long(), pos % self.tpb

    def _write(self, table_row: torch.Tensor, tr: _Track, lo: int, hi: int) -> None:
        if hi <= lo:
            return
        blocks, offs = self._where(table_row, lo, hi)
        vals = self.expected(tr.fingerprints[lo:hi])
        for layer in range(self.layers):
            self.cache.kv_pool(layer)[blocks, :, offs] = vals[:, layer]

    def read(self, table_row: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        blocks, offs = self._where(table_row, lo, hi)
        return torch.stack([self.cache.kv_pool(layer)[blocks, :, offs]
                            for layer in range(self.layers)], dim=1)

    def _check(self, seq_id: Hashable, table_row: torch.Tensor, tr: _Track) -> None:
        got = self.read(table_row, 0, tr.check_upto)
        want = self.expected(tr.fingerprints[: tr.check_upto])
        bad = (got != want).flatten(1).any(dim=1)
        n_bad = int(bad.sum())
        self.checked_tokens += tr.check_upto
        if n_bad:
            self.mismatched_tokens += n_bad
            if self.first_mismatch is None:
                pos = int(bad.nonzero()[0])
                self.first_mismatch = (f"sequence {seq_id!r} position {pos} "
                                       f"(block slot {int(table_row[pos // self.tpb])})")
