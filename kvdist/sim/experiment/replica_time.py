"""One replica's part of a run of replicas in real time (``run --compare`` of a job of
replicas, :mod:`kvdist.sim.experiment.replica_compare`).

The same replica as the step-counted job's (:func:`kvdist.sim.experiment.replica_job.
replica`: its TP group, its own scheduler, admission behind prefetches, the model
over the group), with three differences: requests arrive in seconds
(``Request.arrival_s``, open loop at ``workload.request_rate``) and are routed as
they arrive by rank 0's router (:mod:`kvdist.sim.experiment.route_feed`), so the
scheduler is open-ended (``Scheduler.add``, ``close``); the clock is the wall clock
from the job's common start, paused while the run checks what the cache handed back;
latencies are recorded (first and last token of every request) and returned by the
replica's TP rank 0. The code path is the same on CPU and on CUDA."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ... import faults
from ...config import CacheConfig
from ..engine.model import Decoder
from ..engine.parallel import TensorParallel
from ..engine.scheduler import Running, Scheduler, StepPlan
from .admission import PrefetchGate
from .driver import Simulation
from .kv_router import Policy
from .options import RunOptions
from .parts import RunParts, abandon, engine, open_cache
from .replica_job import ReplicaFigures, ReplicaReporter
from .route_feed import EventFeed, Inbox, RoutedTime, Router, router_endpoint
from .route_net import bind_host, exchange
from .workload import Trace

__all__ = ["TimedReporter", "timed_replica"]

# The router's policy and KV-event feed, built on rank 0 once the replicas' caches are
# open (the feed subscribes to their publishers): (config, replicas, every replica's
# events (endpoint, replay endpoint); None where it publishes none) -> both.
PolicyMaker = Callable[[CacheConfig, int, list[tuple[str, str | None]]], tuple[Policy, EventFeed | None]]


class TimedReporter(ReplicaReporter):
    """A timed replica's reporting: finished requests go back to the router (TP rank
    0), the figures carry the replica's latencies and the router's routes."""

    def __init__(self, world: TensorParallel, trace: Trace, gate: PrefetchGate, *, phase: str, remote: bool,
                 inbox: Inbox | None, router: Router | None):
        super().__init__(world, trace, np.zeros(0, dtype=np.int64), gate, phase=phase, first=False,
                         remote=remote)
        self.inbox, self.router = inbox, router
        self.label = phase

    def header(self, sim: Simulation) -> str:
        return f"[{self.phase}] {sim.cache.num_replicas} replicas x TP {sim.cache.tp_size}, remote tier " \
               f"{'on' if self.remote else 'off'}, open loop at {sim.w.request_rate:g} requests/s"

    def step(self, plan: StepPlan, appends: list[tuple[int, int]], done: list[Running]) -> None:
        super().step(plan, appends, done)
        if self.inbox is not None:
            self.inbox.finished([r.req.rid for r in done])

    def results(self, sim: Simulation) -> ReplicaFigures:
        if self.router is not None:
            self.router.close()  # every request was routed (the schedulers closed): its routes are final
            self.routes = np.asarray(self.router.routes)
        out = super().results(sim)
        out.figures.requests = sim.sched.total  # routed here (the run's trace is the whole one)
        out.latency = sim.latency if sim.cache.tp_rank == 0 else None
        out.router = self.router.stats() if self.router is not None else None
        return out

    def close(self) -> None:
        try:
            if self.router is not None:
                self.router.close()
        finally:
            if self.inbox is not None:
                self.inbox.close()


def timed_replica(cfg: CacheConfig, opts: RunOptions, comm, *, world: TensorParallel, trace: Trace,
                  phase: str, model: Decoder, policy: PolicyMaker, think_s: float = 0.0) -> Simulation:
    """One rank's part of one timed run (collective over the job): the cache, the TP
    group (split off ``world``), the model built already (``model``, on this group),
    the inbox (TP rank 0) and the router (rank 0: a chat's next turn arrives
    ``think_s`` at the earliest after its previous turn finished), the routed clock."""
    server, cache = open_cache(cfg, opts, comm)
    parts = inbox = router = None
    try:
        group = world.mpi.Split(cache.replica, cache.rank) if world.mpi is not None else None
        try:
            tp = TensorParallel.of(cfg, group)
        finally:
            if group is not None:
                group.Free()
        try:
            w = cfg.workload
            gate = PrefetchGate(cache)
            sched = Scheduler(Trace([], trace.system_prompts), max_batch=w.max_batch,
                              max_prefill_tokens=w.max_prefill_tokens,
                              gpu_blocks=cache.stats()["capacity_blocks"]["gpu"],
                              tokens_per_block=cache.layout.tokens_per_block, gate=gate, open_ended=True)
            placement, model = engine(cfg, cache, tp, comm, model)
            host = bind_host(cfg)  # loopback unless cache.events.endpoint binds elsewhere
            inbox = Inbox(len(trace.requests), host) if cache.tp_rank == 0 else None
            boxes, pubs = exchange(world, cfg, inbox.endpoint if inbox is not None else None,
                                   cache.stats()["events"])  # TP rank 0's publisher, where events are on
            if world.rank == 0:
                chosen, events = policy(cfg, cache.num_replicas, pubs)
                router = Router(trace.requests, chosen, boxes, events, think_s=think_s, host=host)
            at = router_endpoint(world, router)
            if inbox is not None:
                inbox.connect(at)
            clock = RoutedTime(cache.device, tp, world, inbox, trace.requests, router)
            ahead = w.run_ahead if w.run_ahead is not None else cache.device.type == "cuda"
            parts = RunParts(cache, tp, trace, sched, clock, model, placement, server, look_ahead=False,
                             run_ahead=ahead, world=world)
        except BaseException:
            if parts is None:
                tp.free()
            raise
        faults.inject("run_setup", cache.rank)
        reporter = TimedReporter(world, trace, gate, phase=phase, remote=cfg.distributed.remote.enabled,
                                 inbox=inbox, router=router)
    except BaseException as e:
        for end in (router, inbox):
            if end is not None:
                end.close()
        abandon(cache, server, parts, e)
        raise
    return Simulation(cfg, opts, parts, reporter)
