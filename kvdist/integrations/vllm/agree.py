"""What the workers report, agreed across the TP ranks when every rank runs its own
scheduler (vLLM's ``distributed_executor_backend="external_launcher"``: one engine per
process, ``tensor_parallel_size`` processes started by ``mpiexec``).

vLLM's own executors hand every worker's connector output to the one scheduler through
``KVOutputAggregator``: a request's saves or asynchronous loads are finished once every
worker has named them, failed blocks are the union, and the figures the MIN. Under
``external_launcher`` each process's scheduler gets its own worker's output alone, and
vLLM relies on every rank's scheduler taking identical decisions (its determinism
assumption): a save finished on one rank a step before the others, a disk read that
failed on one rank, or one rank's slower disk figures would make the ranks' schedulers
free, recompute or cut different blocks, and their next collectives would not match.

So each step every rank gathers all ranks' reports (``ExternalCache.allgather``, one
collective over kvdist's communicator) and every rank applies the same rule to the same
data (``Agreement.step``): the result is identical on every rank and is what vLLM's
aggregator would have given the one scheduler of an ``mp`` executor. A request named by
some ranks only is kept until the last rank names it (ranks name each request once)."""

from __future__ import annotations

__all__ = ["Agreement", "Report"]

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Report:
    """One rank's report of one step (what ``KVConnectorOutput`` carries)."""

    saved: frozenset[str]
    loaded: frozenset[str]
    failed: frozenset[int]
    figures: tuple[int, ...]


class Agreement:
    """The rule every rank applies to all ranks' reports of a step (see the module
    docstring). ``_saved`` / ``_loaded``: per request, how many ranks have named it so
    far (each rank names a request once)."""

    def __init__(self, world_size: int):
        assert world_size >= 1, f"a world of {world_size} ranks"
        self.world_size = world_size
        self._saved: Counter[str] = Counter()
        self._loaded: Counter[str] = Counter()

    def step(self, reports: list[Report]) -> Report:
        """All ranks' reports of this step, in rank order -> the agreed report: the
        requests every rank has now named, every rank's failed blocks, the MIN figures."""
        assert len(reports) == self.world_size, f"{len(reports)} reports from {self.world_size} ranks"
        return Report(self._count(self._saved, [r.saved for r in reports]),
                      self._count(self._loaded, [r.loaded for r in reports]),
                      frozenset().union(*(r.failed for r in reports)),
                      tuple(min(v) for v in zip(*(r.figures for r in reports))))

    def _count(self, seen: Counter[str], named: list[frozenset[str]]) -> frozenset[str]:
        for names in named:
            seen.update(names)
        done = frozenset(r for r in set().union(*named) if seen[r] >= self.world_size)
        for r in done:
            del seen[r]
        return done

    def pending(self) -> set[str]:
        """Requests some ranks but not all have named."""
        return set(self._saved) | set(self._loaded)
