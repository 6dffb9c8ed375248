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

import time

import numpy as np

from ...config import CacheConfig
from ..engine.parallel import TensorParallel
from ..engine.scheduler import Scheduler, StepPlan
from .admission import PrefetchGate
from .ceiling import StepLog
from .driver import Running, RunOptions, Simulation
from .router import route, split
from .workload import Trace, generate

STAT_KEYS = ("hit_tokens", "prompt_tokens", "bytes_offloaded", "bytes_onboarded", "bytes_demoted",
             "blocks_moved", "evictions_by_tier", "capacity_blocks", "block_bytes", "bookkeeping_seconds",
             "transfer_seconds", "bytes_fetched_remote", "remote_misses")


def phases(cfg: CacheConfig) -> list[tuple[str, bool]]:
    """``(name, remote enabled)`` of the runs: isolated, then sharing when configured."""
    return [("isolated", False)] + ([("sharing", True)] if cfg.distributed.remote.enabled else [])


class ReplicaSimulation(Simulation):
    """One rank's part of one run of a replicated job."""

    def __init__(self, cfg: CacheConfig, opts: RunOptions, comm, *, world: TensorParallel, trace: Trace,
                 phase: str, first: bool):
        self.world, self.full_trace, self.phase, self.first = world, trace, phase, first
        self.routes: np.ndarray | None = None
        self.log = StepLog()
        self.t0 = 0.0  # the wall clock's start (time.monotonic), the same moment everywhere
        super().__init__(cfg, opts, comm)

    # -- the hooks of Simulation ---------------------------------------------------------------
    def _make_trace(self) -> Trace:
        c = self.cache
        self.routes = route(self.full_trace, c.num_replicas, self.w.routing, c.layout.tokens_per_block)
        return split(self.full_trace, self.routes, c.replica)

    def _make_tp(self) -> TensorParallel:
        """The TP group: the ranks the cache puts in this replica (``cache.replica``; the
        cache keeps its own group private), split off the job's communicator."""
        group = self.world.mpi.Split(self.cache.replica, self.cache.rank)
        try:
            return TensorParallel(group)
        finally:
            group.Free()

    def _make_scheduler(self) -> Scheduler:
        self.gate = PrefetchGate(self.cache)
        return Scheduler(self.trace, max_batch=self.w.max_batch, max_prefill_tokens=self.w.max_prefill_tokens,
                         gpu_blocks=self.capacity["gpu"], tokens_per_block=self.cache.layout.tokens_per_block,
                         gate=self.gate)

    def _setup_reporting(self) -> None:
        """No replays or timeline per run (the job reports once, with the one-cache
        replay); the metrics endpoint on rank 0 (bound before the start) serves replica
        0's figures. The clock starts on every rank of the job at once."""
        self.world.barrier()
        self.t0 = time.monotonic()

    def _look_ahead(self) -> None:
        """The admission gate prefetches each request once its blocks are reserved."""

    def _before_step(self) -> None:
        """The trace's time by the wall clock, one step per ``workload.step_ms``, the
        same on every replica; agreed inside the TP group (the ranks read the clock at
        slightly different moments). With nothing running or waiting, sleep until the
        next arrival."""
        step_s = self.w.step_ms / 1e3
        now = int((time.monotonic() - self.t0) / step_s)
        now = -self.tp.allreduce_min([-now])[0]  # the latest clock of the group
        nxt = self.sched.idle_until()
        if nxt is not None and nxt > now:  # the same on every rank of the group
            time.sleep(max(0.0, self.t0 + nxt * step_s - time.monotonic()))
            now = nxt
        self.sched.advance(now)

    def _after_step(self, plan: StepPlan, appends: list[tuple[int, int]], done: list[Running]) -> None:
        self.log.record(plan, appends, [r.req.rid for r in done])

    def _header(self) -> str:
        c, w = self.cache, self.w
        remote = "on" if self.cfg.distributed.remote.enabled else "off"
        line = f"replicas {self.phase} (remote tier {remote}):"
        if not self.first:
            return line
        counts = np.bincount(self.routes, minlength=c.num_replicas)
        reqs = self.full_trace.requests
        away = sum(1 for r in reqs if r.after >= 0 and self.routes[r.after] != self.routes[r.rid])
        turns = sum(1 for r in reqs if r.after >= 0)
        return "\n".join([
            super()._header(self.full_trace),
            f"  replicas: {c.num_replicas} x TP {c.tp_size}, routing {w.routing}: "
            + ", ".join(f"replica {k} {n:,} requests" for k, n in enumerate(counts))
            + f"; {away:,} of {turns:,} follow-up turns sent away from their previous turn's replica"
            + (f" (users think {w.think_steps} steps between turns)" if w.think_steps else ""),
            line])

    def _progress_label(self) -> str:
        return f"{self.phase} (replica 0)"

    def _results(self) -> dict:
        """This rank's figures (no report: the job assembles every run's at its end).
        Settles the integrity of blocks reused from other replicas first (collective
        over the job: every rank's references)."""
        c, led = self.cache, self.ledger
        refs = self.world.allgather((c.tp_rank, led.ref))
        led.settle([ref for rank, (tp, ref) in enumerate(refs) if tp == c.tp_rank and rank != c.rank])
        s = c.stats()
        chk = self.checks
        return {
            "rank": c.rank, "replica": c.replica, "tp_rank": c.tp_rank, "tiers": list(c.tiers),
            "stats": {k: s[k] for k in STAT_KEYS},
            "requests": len(self.trace.requests), "finished": self.sched.finished, "steps": self.sched.step,
            "ledger": [led.checked_blocks, led.mismatched_blocks, led.unknown_blocks, led.variants,
                       led.first_mismatch],
            "logits": [chk.logits_checked, chk.logits_failed, chk.logits_max_abs_diff],
            "consistency": [chk.consistency_checks, chk.consistency_error],
            "clock": [self.clock.cache_api, self.clock.model],
            "gate": [self.gate.prefetched, self.gate.held],
            "log": self.log.records if c.tp_rank == 0 else None,
            "routes": self.routes.tolist() if c.rank == 0 else None,
            "placement": [p.device for p in self.placement] if c.rank == 0 else None,
            "tolerance": self.tolerance,
        }


def run_replicas(cfg: CacheConfig, opts: RunOptions, comm=None) -> dict:
    """The replicated job on every rank (collective); returns the results everywhere.
    A job that is one replica (``tp_size`` = world size) is the plain main job."""
    from .replica_report import assemble, report

    if opts.requests is not None:
        cfg = cfg.replace(workload={"requests": opts.requests})
    world = TensorParallel(comm)
    try:
        if world.size <= cfg.distributed.tp_size:
            sim = Simulation(cfg, opts, comm)
            try:
                return sim.run()
            finally:
                sim.close()
        started = time.perf_counter()
        trace = generate(cfg.workload)
        parts: dict[str, dict] = {}
        for i, (phase, remote) in enumerate(phases(cfg)):
            sim = ReplicaSimulation(cfg.replace(distributed={"remote": {"enabled": remote}}), opts, comm,
                                    world=world, trace=trace, phase=phase, first=i == 0)
            try:
                parts[phase] = sim.run()
            finally:
                sim.close()
        everyone = world.gather(parts)
        results = None
        if world.rank == 0:
            from mpi4py import MPI  # several replicas: MPI runs

            results = assemble(cfg, trace, everyone, time.perf_counter() - started, solo_comm=MPI.COMM_SELF)
            report(results, opts)
        return world.bcast(results)
    finally:
        world.free()
