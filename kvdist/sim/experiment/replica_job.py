"""The main job as R data-parallel replicas (``distributed.tp_size`` < world size).

Replica r is ranks ``r*T .. r*T+T-1`` (the cache's ``replica``/``tp_rank``); each is a
TP group running its own scheduler over the requests the router sends it
(:mod:`kvdist.sim.experiment.router`, ``workload.routing``), its model's allreduces on the TP
group's communicator. Inside a replica the ranks take identical decisions (SPMD; the
prefetch gate agrees on timing inside the group). Replicas are not coupled after
start-up: nothing spans them during a run, only at its end (the integrity references,
the report).

The trace runs twice, side by side in one job: replicas isolated (the remote tier
off), then sharing (on). The sharing run's steps are then replayed through ONE
bookkeeping cache of the replicas' total capacity (:mod:`kvdist.sim.experiment.ceiling`): the
gap in computed prefill tokens between isolated replicas and that ceiling, and how
much of it sharing closed, are the job's headline (:mod:`kvdist.sim.experiment.replica_report`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ... import faults
from ...config import CacheConfig
from ..engine.parallel import TensorParallel
from ..engine.scheduler import Running, Scheduler, StepPlan
from .admission import PrefetchGate
from .ceiling import StepLog
from .clock import Latencies, WallSteps
from .driver import Simulation
from .options import RunOptions
from .parts import RunParts, abandon, engine, open_cache
from .reporters import describe
from .results import RankFigures
from .router import route, split
from .workload import Trace

__all__ = ["ReplicaFigures", "ReplicaReporter", "phases", "replica"]


def phases(cfg: CacheConfig) -> list[tuple[str, bool]]:
    """``(name, remote enabled)`` of the runs: isolated, then sharing when configured."""
    return [("isolated", False)] + ([("sharing", True)] if cfg.distributed.remote.enabled else [])


@dataclass(slots=True)
class ReplicaFigures:
    """One rank's figures of one run of a replicated job."""

    figures: RankFigures
    gate: tuple[int, int]  # requests prefetched on arrival, held back for their prefetch
    log: list | None  # the replica's steps (StepLog records; its TP rank 0)
    routes: list[int] | None  # every request's replica (rank 0)
    placement: list[str] | None  # every rank's device (rank 0)
    latency: Latencies | None = None  # a timed run's (TP rank 0 of each replica)
    router: dict | None = None  # a timed run's router figures (rank 0: route_feed.Router.stats)


class ReplicaReporter:
    """A replica's reporting: every step logged for the ceiling replay, no replays or
    timeline per run (the job reports once, at its end)."""

    def __init__(self, world: TensorParallel, full_trace: Trace, routes: np.ndarray, gate: PrefetchGate, *,
                 phase: str, first: bool, remote: bool):
        self.world, self.full_trace, self.routes, self.gate = world, full_trace, routes, gate
        self.phase, self.first, self.remote = phase, first, remote
        self.label = f"{phase} (replica 0)"
        self.log = StepLog()

    def header(self, sim: Simulation) -> str:
        c, w = sim.cache, sim.w
        line = f"replicas {self.phase} (remote tier {'on' if self.remote else 'off'}):"
        if not self.first:
            return line
        counts = np.bincount(self.routes, minlength=c.num_replicas)
        reqs = self.full_trace.requests
        away = sum(1 for r in reqs if r.after >= 0 and self.routes[r.after] != self.routes[r.rid])
        turns = sum(1 for r in reqs if r.after >= 0)
        return "\n".join([
            describe(sim, self.full_trace)[0],
            f"  replicas: {c.num_replicas} x TP {c.tp_size}, routing {w.routing}: "
            + ", ".join(f"replica {k} {n:,} requests" for k, n in enumerate(counts))
            + f"; {away:,} of {turns:,} follow-up turns sent away from their previous turn's replica"
            + (f" (users think {w.think_steps} steps between turns)" if w.think_steps else ""),
            line])

    def step(self, plan: StepPlan, appends: list[tuple[int, int]], done: list[Running]) -> None:
        self.log.record(plan, appends, [r.req.rid for r in done])

    def progress(self, stats: dict, finished: int) -> None:
        """The metrics endpoint on rank 0 (bound before the start) serves replica 0's figures."""

    def results(self, sim: Simulation) -> ReplicaFigures:
        """This rank's figures (no report: the job assembles every run's at its end).
        Settles the integrity of blocks reused from other replicas first (collective
        over the job: every rank's references)."""
        c, led = sim.cache, sim.ledger
        refs = self.world.allgather((c.tp_rank, led.ref))
        led.settle([ref for rank, (tp, ref) in enumerate(refs) if tp == c.tp_rank and rank != c.rank])
        mine = RankFigures.collect(c, requests=len(sim.trace.requests), finished=sim.sched.finished,
                                   steps=sim.sched.step, ledger=led, checks=sim.checks, times=sim.times,
                                   tolerance=sim.tolerance)
        return ReplicaFigures(mine, (self.gate.prefetched, self.gate.held),
                              self.log.records if c.tp_rank == 0 else None,
                              self.routes.tolist() if c.rank == 0 else None,
                              [p.device for p in sim.placement] if c.rank == 0 else None)

    def close(self) -> None:
        pass


def replica(cfg: CacheConfig, opts: RunOptions, comm, *, world: TensorParallel, trace: Trace, phase: str,
            first: bool) -> Simulation:
    """One rank's part of one run of a replicated job (collective): the share of the
    trace the router sends its replica, the model over the replica's TP group (the
    ranks the cache puts in it, split off the job's communicator), admission behind
    prefetches, the trace's time by the wall clock."""
    server, cache = open_cache(cfg, opts, comm)
    parts = None
    try:
        w = cfg.workload
        routes = route(trace, cache.num_replicas, w.routing, cache.layout.tokens_per_block)
        mine = split(trace, routes, cache.replica)
        group = world.mpi.Split(cache.replica, cache.rank)
        try:
            tp = TensorParallel.of(cfg, group)
        finally:
            group.Free()
        try:
            gate = PrefetchGate(cache)
            sched = Scheduler(mine, max_batch=w.max_batch, max_prefill_tokens=w.max_prefill_tokens,
                              gpu_blocks=cache.stats()["capacity_blocks"]["gpu"],
                              tokens_per_block=cache.layout.tokens_per_block, gate=gate)
            placement, model = engine(cfg, cache, tp, comm, None)
            clock = WallSteps(cache.device, tp, world, w.step_ms)
            parts = RunParts(cache, tp, mine, sched, clock, model, placement, server, look_ahead=False,
                             world=world)
        except BaseException:
            if parts is None:
                tp.free()
            raise
        faults.inject("run_setup", cache.rank)
        reporter = ReplicaReporter(world, trace, routes, gate, phase=phase, first=first,
                                   remote=cfg.distributed.remote.enabled)
    except BaseException as e:
        abandon(cache, server, parts, e)
        raise
    return Simulation(cfg, opts, parts, reporter)
