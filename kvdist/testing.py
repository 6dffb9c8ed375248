"""Test support: ``create`` builds a cache with test seams (``kvdist.seams.Seams``), and
an integrity driver plays the forward pass against a cache and checks every reused
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

from .cache import KVCache, build
from .config import CacheConfig
from .seams import Seams

__all__ = ["IntegrityDriver", "Seams", "create", "prefix_fingerprints"]

_MOD = (1 << 61) - 1


def create(cfg: CacheConfig | dict | str, seams: Seams, comm=None) -> KVCache:
    """``kvdist.create`` with ``seams``: its switches are read while the cache is built,
    its records fill while it runs, and its handles point at the built cache's parts."""
    return build(cfg, comm, seams)


def prefix_fingerprints(tokens: Sequence[int], state: int = 0) -> list[int]:
    """Rolling hash after each token (``state`` is the value before ``tokens[0]``)."""
    out = []
    h = state
    for t in tokens:
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

    def __init__(self, cache: KVCache, overlap: bool = False, salt: int = 0, host_reader: bool = False):
        self.cache = cache
        self.salt = salt  # mixed into the pattern: e.g. the TP rank, so shards differ
        # Simulated streams: the forward pass is a 'kernel' on the compute stream, queued
        # behind the table's staging copy. With ``overlap`` it stays queued while the next
        # step is prepared (a scheduler one step ahead of the device) and runs only after
        # that step's table was staged; otherwise it runs at once. ``host_reader``: the
        # pass runs on the host as soon as block_table returns, through the public API
        # only, as a CPU engine's attention does.
        self._compute = None if host_reader else cache.simulated_compute
        self.overlap = overlap
        if overlap and self._compute is not None:
            self._compute.runs_behind = True  # tables too wait on the stream, like the passes
        self._in_flight = None  # the previous step's forward pass, still queued (overlap)
        lay = cache.layout
        self.layers, self.heads, self.dim = lay.num_layers, lay.num_kv_heads, lay.head_dim
        self.tpb = lay.tokens_per_block
        self.dtype = cache.kv_pool(0).dtype
        self._num_blocks = cache.kv_pool(0).shape[0]
        self.seqs: dict[Hashable, _Track] = {}
        self._touched: list[Hashable] = []
        self.mismatched_tokens = 0
        self.checked_tokens = 0
        self.first_mismatch: str | None = None
        # The per-element offsets of the pattern, [layer, kv, head, dim].
        L, H, D = self.layers, self.heads, self.dim
        self._offsets = (torch.arange(L).view(L, 1, 1, 1) * 13 + torch.arange(2).view(1, 2, 1, 1) * 7
                         + torch.arange(H).view(1, 1, H, 1) * 3 + torch.arange(D).view(1, 1, 1, D))

    def expected(self, fingerprints: list[int]) -> torch.Tensor:
        """``[n, layer, kv, head, dim]`` values in the cache's dtype, on its device."""
        base = torch.tensor([(f + 7919 * self.salt) % 10007 for f in fingerprints],
                            dtype=torch.int64).view(-1, 1, 1, 1, 1)
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
        return reused

    def append(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        self.cache.append_tokens(seq_id, tokens)
        tr = self.seqs[seq_id]
        state = tr.fingerprints[-1] if tr.fingerprints else 0
        tr.write_from = len(tr.tokens)
        tr.check_upto = 0
        tr.tokens.extend(tokens)
        tr.fingerprints.extend(prefix_fingerprints(tokens, state))
        self._touched.append(seq_id)

    def compute(self) -> torch.Tensor:
        """block_table, then the forward pass: check reused positions, write the new ones
        (queued on the simulated compute stream; see ``__init__`` for ``overlap``)."""
        ids = list(dict.fromkeys(self._touched))
        table = self.cache.block_table(ids)
        work = []  # what this step's pass does, fixed now: the tracks change under it
        for row, seq_id in enumerate(ids):
            tr = self.seqs[seq_id]
            work.append((row, seq_id, tr, tr.check_upto, tr.write_from, len(tr.tokens)))
            tr.check_upto = 0
        forward = lambda: self._forward(table, work)
        if self._compute is None:
            forward()
            return table
        previous, self._in_flight = self._in_flight, self._compute.kernel(forward)
        if not self.overlap:
            self.drain()
        elif previous is not None:
            self._compute.force(previous)
        return table

    def drain(self) -> None:
        """Run the forward pass still queued on the simulated compute stream, if any."""
        if self._in_flight is not None:
            op, self._in_flight = self._in_flight, None
            self._compute.force(op)

    def _forward(self, table: torch.Tensor, work: list) -> None:
        for row, seq_id, tr, check_upto, lo, hi in work:
            if check_upto:
                self._check(seq_id, table[row], tr, check_upto)
            self._write(seq_id, table[row], tr, lo, hi)

    def end(self) -> None:
        self.cache.end_step()

    def release(self, seq_id: Hashable) -> None:
        self.cache.release(seq_id)
        del self.seqs[seq_id]

    # -- memory access through the table --------------------------------------------------------
    def _where(self, table_row: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(lo, hi, device=table_row.device)
        return table_row[pos // self.tpb].long(), pos % self.tpb

    def _write(self, seq_id: Hashable, table_row: torch.Tensor, tr: _Track, lo: int, hi: int) -> None:
        if hi <= lo:
            return
        blocks, offs = self._where(table_row, lo, hi)
        vals = self.expected(tr.fingerprints[lo:hi])
        ok = (blocks >= 0) & (blocks < self._num_blocks)
        n_wild = hi - lo - int(ok.sum())
        if n_wild:  # a table entry that is no block (padding, poison): a GPU would scribble or fault
            pos = lo + int((~ok).nonzero()[0])
            self._record(n_wild, f"sequence {seq_id!r} position {pos} written through entry "
                                 f"{int(table_row[pos // self.tpb])}")
            blocks, offs, vals = blocks[ok], offs[ok], vals[ok]
        for layer in range(self.layers):
            self.cache.kv_pool(layer)[blocks, :, offs] = vals[:, layer]

    def read(self, table_row: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        blocks, offs = self._where(table_row, lo, hi)
        return torch.stack([self.cache.kv_pool(layer)[blocks, :, offs]
                            for layer in range(self.layers)], dim=1)

    def _check(self, seq_id: Hashable, table_row: torch.Tensor, tr: _Track, upto: int) -> None:
        row = table_row[: -(-upto // self.tpb)]
        no_block = (row < 0) | (row >= self._num_blocks)  # padding or poison where a block must be
        got = self.read(torch.where(no_block, 0, row), 0, upto)
        want = self.expected(tr.fingerprints[:upto])
        bad = (got != want).flatten(1).any(dim=1) | no_block.repeat_interleave(self.tpb)[:upto]
        n_bad = int(bad.sum())
        self.checked_tokens += upto
        if n_bad:
            pos = int(bad.nonzero()[0])
            self._record(n_bad, f"sequence {seq_id!r} position {pos} "
                                f"(block slot {int(table_row[pos // self.tpb])})")

    def _record(self, n_bad: int, where: str) -> None:
        self.mismatched_tokens += n_bad
        if self.first_mismatch is None:
            self.first_mismatch = where
