"""The persistent host-side block table: one int32 row per live sequence, -1 past
its last block. Rows follow the sequences' slot lists lazily (a table writes only the
blocks added since the previous one), rows of finished sequences are reclaimed and
rebound to new ones, and building a step's table is one vectorized gather.

This table is scheduler state, rewritten every step: it is never the source of a
device copy. Tables are gathered out of it into a staging buffer (``Stager``), which is
what rule S3 guards."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

PAD = -1
DEFAULT_ROWS = 64  # initial rows of a table (it grows)


@dataclass(slots=True)
class _Row:
    seq: object  # the sequence object this row mirrors (identity tells a re-added id apart)
    row: int
    n: int = 0  # leading entries written


class TableRows:
    """Rows for objects with a ``slots`` sequence of ints, keyed by sequence id."""

    def __init__(self, rows: int = DEFAULT_ROWS, width: int = 32):
        assert rows > 0 and width > 0, f"bad initial table shape {rows}x{width}"
        self.table = np.full((rows, width), PAD, dtype=np.int32)
        self._bound: dict[Hashable, _Row] = {}
        self._free: list[int] = list(range(rows - 1, -1, -1))
        self._scratch = np.empty((0, width), dtype=np.int32)  # whole rows, for gather
        self.reclaimed = 0  # rows taken back from finished sequences (free for new ones)

    # -- building a table ----------------------------------------------------------------------
    def rows_for(self, seq_ids: Sequence[Hashable],
                 seqs: Mapping[Hashable, object]) -> tuple[np.ndarray, int]:
        """(row of each id, widest row) after bringing those rows up to date."""
        bound, get = self._bound, seqs.get
        rows: list[int] = []
        append = rows.append
        width = 0
        for sid in seq_ids:  # the per-step loop: kept to a few dict lookups per sequence
            seq = get(sid)
            r = bound.get(sid)
            if r is None or r.seq is not seq:
                if seq is None:
                    raise KeyError(f"unknown sequence {sid!r}")
                r = self._bind(sid, seq, seqs)
            n = len(seq.slots)
            if n != r.n:
                self._sync(r, seq.slots, n)
            append(r.row)
            if n > width:
                width = n
        return np.array(rows, dtype=np.intp), width

    def gather(self, rows: np.ndarray, width: int, out: np.ndarray) -> np.ndarray:
        """``out[i] = table[rows[i], :width]`` (``out`` may be a staging buffer)."""
        assert out.shape == (len(rows), width) and out.dtype == np.int32, \
            f"out is {out.shape} {out.dtype}, want {(len(rows), width)} int32"
        if width == self.table.shape[1]:
            np.take(self.table, rows, axis=0, out=out, mode="clip")
            return out
        # The batch lacks the widest row. numpy's take would copy the non-contiguous
        # table[:, :width] whole first; whole rows into scratch plus a strided copy is faster.
        n = len(rows)
        cols = self.table.shape[1]
        if self._scratch.shape[1] != cols:  # the table was widened or narrowed: start afresh
            self._scratch = np.empty((n, cols), np.int32)
        elif self._scratch.shape[0] < n:  # more rows: grow geometrically, never past the table
            self._scratch = np.empty((min(max(n, 2 * self._scratch.shape[0]), self.table.shape[0]),
                                      cols), np.int32)
        scratch = self._scratch[:n]
        np.take(self.table, rows, axis=0, out=scratch, mode="clip")
        np.copyto(out, scratch[:, :width])
        return out

    # -- row lifecycle ---------------------------------------------------------------------------
    def _bind(self, sid: Hashable, seq: object, seqs: Mapping[Hashable, object]) -> _Row:
        old = self._bound.pop(sid, None)
        if old is not None:  # the id was released and added again
            self._unbind(old)
        if not self._free:
            self._reclaim(seqs)
        r = _Row(seq, self._free.pop())
        self._bound[sid] = r
        return r

    def _unbind(self, r: _Row) -> None:
        self.table[r.row, : r.n] = PAD
        self._free.append(r.row)
        self.reclaimed += 1

    def _reclaim(self, seqs: Mapping[Hashable, object]) -> None:
        """Free the rows of finished sequences; double the rows if few come back (so a
        sweep costs O(1) per bind, amortized)."""
        for sid, r in list(self._bound.items()):
            if seqs.get(sid) is not r.seq:
                del self._bound[sid]
                self._unbind(r)
        # Narrow to the widest live row, so the next batches gather in one pass again.
        widest = max((r.n for r in self._bound.values()), default=1)
        if widest < self.table.shape[1]:
            self.table = np.ascontiguousarray(self.table[:, :widest])
        rows, width = self.table.shape
        if 4 * len(self._free) <= rows:
            grown = np.full((2 * rows, width), PAD, dtype=np.int32)
            grown[:rows] = self.table
            self.table = grown
            self._free.extend(range(2 * rows - 1, rows - 1, -1))

    def _sync(self, r: _Row, slots, n: int) -> None:
        if n > self.table.shape[1]:
            # Exactly as wide as the widest row, so a batch that holds it (the usual decode
            # batch) is gathered in one pass. A widening copies the table: once per block of
            # the longest sequence, about 2/tokens_per_block of what staging its tables costs.
            rows, width = self.table.shape
            grown = np.full((rows, n), PAD, dtype=np.int32)
            grown[:, :width] = self.table
            self.table = grown
        if n > r.n:
            self.table[r.row, r.n : n] = slots[r.n : n]
        else:
            self.table[r.row, n : r.n] = PAD
        r.n = n

    # -- checks ----------------------------------------------------------------------------------
    def row_of(self, sid: Hashable) -> int | None:
        r = self._bound.get(sid)
        return None if r is None else r.row

    def check_invariants(self) -> None:
        rows = self.table.shape[0]
        bound_rows = [r.row for r in self._bound.values()]
        assert len(set(bound_rows)) == len(bound_rows), "a row is bound twice"
        assert not set(bound_rows) & set(self._free), "a row is both bound and free"
        assert len(bound_rows) + len(self._free) == rows, "a row is lost"
        assert (self.table[self._free] == PAD).all(), "a free row holds entries"
        for r in self._bound.values():
            slots = list(r.seq.slots)
            assert self.table[r.row, : r.n].tolist() == slots[: r.n], f"row {r.row} differs from its sequence"
            assert (self.table[r.row, r.n :] == PAD).all(), f"row {r.row} holds entries past its length"
