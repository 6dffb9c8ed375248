"""Disk loads in flight per sequence: what a prefetch's disk reads leave for a scheduler
to wait on, so that no step blocks on storage (vLLM v1's asynchronous loads: a request
whose external blocks load in the background waits a step, ``get_num_new_matched_tokens``
returning ``(n, True)``, and joins the batch once ``get_finished`` names it).

``KVCache.prefetch`` moves a prompt's disk blocks into the host tier (``PROMOTE``); with
an executor whose disk batches run in the background (``Executor.background_disk``) the
events of those batches are kept here under the sequence's id. At every ``end_step``
each rank polls them (never blocking: an event query, a worker future's state) and the
TP group MIN-reduces the answers, riding on the step's one agreement; a sequence all of
whose reads every rank has on the host is *landed* from then on, and
``KVCache.prefetch_ready`` says so at the next step, alike on every rank (R1). Its
``add_sequence`` then onboards host blocks whose reads are done: the host never waits
for the disk there (``stats()["host_waits_on_disk"]``).

Invariants: the sequences waiting are the same, in the same order, on every TP rank
(``start`` is called alike: whether a prefetch promoted anything depends only on the
cache's state, which the ranks share; ``agree`` takes the group's answers); a sequence
leaves at its agreed landing or its ``add_sequence`` (``forget``), whichever is first."""

from __future__ import annotations

from collections.abc import Hashable

from .transfer import Event, Executor

__all__ = ["DiskLoads"]


class DiskLoads:
    """The disk reads each prefetched sequence still waits for (see the module docstring)."""

    def __init__(self, executor: Executor):
        self.executor = executor
        self._waiting: dict[Hashable, list[Event]] = {}  # in prefetch order: identical on every TP rank
        self.started = 0  # sequences that had reads to wait for
        self.steps_waited = 0  # sum over them of the agreements that found them not landed

    def start(self, seq_id: Hashable, events: list[Event]) -> None:
        """``seq_id``'s prefetch queued the disk reads ``events`` (none: nothing to wait
        for, or an executor that did them inside the call)."""
        if not events or not self.executor.background_disk:
            return
        known = self._waiting.get(seq_id)
        if known is None:
            self.started += 1
            self._waiting[seq_id] = list(events)
        else:  # prefetched again before it landed: it waits for both
            known.extend(events)

    def waiting(self, seq_id: Hashable) -> bool:
        """Whether ``seq_id``'s reads are not agreed landed yet."""
        return seq_id in self._waiting

    def forget(self, seq_id: Hashable) -> None:
        """``seq_id`` was admitted (or given up): nothing waits for its reads any more."""
        self._waiting.pop(seq_id, None)

    def local(self) -> list[int]:
        """Per sequence waiting, in order: 1 if this rank has all its reads, else 0 (to
        be MIN-reduced over the TP group; [] when none waits, alike on every rank)."""
        poll = self.executor.poll
        return [int(poll(events)) for events in self._waiting.values()]

    def agree(self, landed: list[int]) -> None:
        """Adopt the group's answers to ``local`` (every rank passes the same list)."""
        assert len(landed) == len(self._waiting), \
            f"{len(landed)} answers for {len(self._waiting)} sequences waiting for disk reads"
        for seq_id, ok in zip(list(self._waiting), landed):
            if ok:
                del self._waiting[seq_id]
            else:
                self.steps_waited += 1

    def stats(self) -> dict[str, int]:
        return {"waiting": len(self._waiting), "started": self.started, "steps_waited": self.steps_waited}
