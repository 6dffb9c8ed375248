"""The ceiling of sharing between replicas: the replicas' steps replayed through ONE
bookkeeping-only cache with the capacity of all of them together.

Every replica logs its steps (:class:`StepLog`: the trace's clock, admitted requests,
decode appends, finished requests). After the run the logs are merged by clock — the
steps the replicas took at the same moment become one step of the one cache (the k-th
step of every replica within one tick of the clock together) — and replayed through a
cache of ``R x`` one replica's blocks in every tier
(:func:`~kvdist.sim.experiment.shadows.bookkeeping_cache`). That is what sharing could reach at
best on exactly the requests and steps the replicas ran: every block any replica
computed is visible to all, none is held twice. The same replay of one replica's
log at its own capacity is that replica isolated."""

from __future__ import annotations

import tempfile
from collections import defaultdict
from dataclasses import dataclass, field

from ...config import CacheConfig
from ..engine.scheduler import Scheduler, StepPlan
from .shadows import bookkeeping_cache, replay_step
from .workload import Trace


@dataclass(slots=True)
class StepRecord:
    clock: int
    prefills: list[int]  # request ids admitted
    appends: list[tuple[int, int]]  # (request id, decoded token)
    finished: list[int]  # request ids released at the end of the step


@dataclass(slots=True)
class StepLog:
    records: list[StepRecord] = field(default_factory=list)

    def record(self, plan: StepPlan, appends: list[tuple[int, int]], finished: list[int]) -> None:
        if plan.batch:  # a step that only waited for prefetches changes no cache
            self.records.append(StepRecord(plan.clock, [r.req.rid for r in plan.prefills], appends, finished))


def schedule_log(trace: Trace, sched: Scheduler) -> StepLog:
    """The steps ``sched`` (ungated: a pure function of ``trace``) takes, without any
    cache or model: for planning traces and for tests."""
    log = StepLog()
    while not sched.done():
        plan = sched.next_step()
        appends = [(run.req.rid, int(run.req.output[run.generated - 1])) for run in plan.decodes]
        log.record(plan, appends, [run.req.rid for run in sched.complete(plan)])
    return log


def replay(cfg: CacheConfig, trace: Trace, logs: list[StepLog], capacity: dict[str, int],
           priority: int, comm=None) -> dict[str, int]:
    """Prompt tokens reused per tier when ``logs`` (one per replica) run through one
    bookkeeping cache of ``len(logs) x capacity`` blocks per tier, steps merged by
    clock (replica order inside a merged step). ``comm`` must be a one-rank
    communicator."""
    scale = len(logs)
    by_clock: dict[tuple[int, int], list[StepRecord]] = defaultdict(list)
    for log in logs:
        within: dict[int, int] = defaultdict(int)  # steps of this replica in one tick
        for rec in log.records:
            by_clock[rec.clock, within[rec.clock]].append(rec)
            within[rec.clock] += 1
    requests = {r.rid: r for r in trace.requests}
    with tempfile.TemporaryDirectory(prefix="kvdist-ceiling-") as disk_dir:
        cache = bookkeeping_cache(cfg, gpu=scale * capacity["gpu"], host=scale * capacity.get("host", 0),
                                  disk=scale * capacity.get("disk", 0), disk_dir=disk_dir, comm=comm)
        try:
            for clock in sorted(by_clock):
                recs = by_clock[clock]
                replay_step(cache, [requests[rid] for rec in recs for rid in rec.prefills],
                            [a for rec in recs for a in rec.appends],
                            [rid for rec in recs for rid in rec.finished], priority)
            return dict(cache.stats()["hit_tokens"])
        finally:
            cache.close()
