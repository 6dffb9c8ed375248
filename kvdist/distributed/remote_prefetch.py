"""Prefetches of the remote tier (``cache.prefetch``; docs/design.md, "Remote tier"):
a request's remote blocks started before its admission, landing in the host tier,
and what the scheduler asks of them — ``ready`` once every block landed or was given
up on every TP rank (the same step on each: the verdicts are agreed) — and what
``add_sequence`` needs later: the hashes landed for the request, to count its remote
hits by the tier they were found in.

A prefetch asked between steps is *deferred*: it starts right after the next
``begin_step`` (its landing slots may evict blocks, whose copies must follow the last
step's kernels, S4). Every TP rank of a replica asks, defers and starts the same
prefetches (its scheduler's calls are the same), so their batches are equal (R1)."""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from .remote_figures import RemoteCounters
from .remote_plan import Landings, LocalSlots
from .transport import Batch

__all__ = ["PREFETCH_RECORDS", "Prefetches"]

PREFETCH_RECORDS = 4096  # prefetches remembered for add_sequence's hit accounting


class Prefetches:
    """The prefetches of one rank (see the module docstring)."""

    def __init__(self, landings: Landings, slots: LocalSlots, counters: RemoteCounters):
        self.landings, self.slots, self.counters = landings, slots, counters
        self.tpb = slots.tokens_per_block
        self._batches: dict[Hashable, list[Batch]] = {}  # seq -> its batches ([]: deferred)
        self._deferred: dict[Hashable, list[int]] = {}  # asked for between steps: seq -> hashes
        self._landed: dict[Hashable, set[int]] = {}  # seq -> hashes landed for it

    def ask(self, seq_id: Hashable, tokens: Iterable[int], now: bool) -> tuple[int, list[Batch]]:
        """(how many of the prompt's remote blocks are on their way, the batches started).
        Outside a step (``now`` False) nothing starts until ``start_deferred``; the count
        is then the blocks the directory lists."""
        tokens = tokens if isinstance(tokens, list | tuple) else list(tokens)
        full = self.slots.block_hashes(tokens)
        hashes = full[: max(len(tokens) - 1, 0) // self.tpb]  # those add_sequence may reuse
        if not now:
            n = self._listed(hashes)
            if n:
                self._deferred[seq_id] = hashes
                self._batches.setdefault(seq_id, [])
            return n, []
        batches = self._start(seq_id, hashes)
        return sum(len(b) for b in batches), batches

    def start_deferred(self) -> list[Batch]:
        """Start the prefetches asked for between steps; the batches started."""
        deferred, self._deferred = self._deferred, {}
        out: list[Batch] = []
        for seq_id, hashes in deferred.items():
            out.extend(self._start(seq_id, hashes))
        return out

    def _start(self, seq_id: Hashable, hashes: list[int]) -> list[Batch]:
        batches = self.landings.plan(hashes[len(self.slots.cached_prefix(hashes)):], seq_id)
        if batches:
            self._batches.setdefault(seq_id, []).extend(batches)
            self.counters.prefetches += 1
        return batches

    def _listed(self, hashes: list[int]) -> int:
        """The blocks after the local prefix a prefetch would start now (none of a
        ``near`` peer's: add_sequence fetches those)."""
        return len(self.landings.wanted(hashes[len(self.slots.cached_prefix(hashes)):], True))

    def ready(self, seq_id: Hashable) -> bool:
        """Whether nothing prefetched for ``seq_id`` is still undecided (True if never
        prefetched)."""
        if seq_id in self._deferred:
            return False
        batches = self._batches.get(seq_id)
        if batches is None:
            return True
        if all(b.decided.all() for b in batches):
            del self._batches[seq_id]
            return True
        return False

    def landed_for(self, seq_id: Hashable, hashes: set[int]) -> None:
        """The replica landed ``hashes`` for the prefetch of ``seq_id``."""
        self._landed.setdefault(seq_id, set()).update(hashes)

    def admitted(self, seq_id: Hashable) -> set[int]:
        """``seq_id`` is being admitted: forget its prefetch; the hashes landed for it."""
        landed = self._landed.pop(seq_id, set()) if self._landed else set()
        if self._batches:
            self._batches.pop(seq_id, None)
        if self._deferred:
            self._deferred.pop(seq_id, None)
        return landed

    def trim(self) -> None:
        """Forget the oldest record of a prefetch never admitted, past ``PREFETCH_RECORDS``."""
        if len(self._landed) > PREFETCH_RECORDS:
            self._landed.pop(next(iter(self._landed)))
