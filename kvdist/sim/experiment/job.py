"""A whole job of the main simulation on every rank (collective): the main job
(``solo``: one run over the whole trace, the model over every rank), or a job of
replicas (``run_replicas``: each replica its share of the trace, isolated and then
sharing, with the one-cache ceiling replay). ``run`` picks by
``distributed.tp_size``."""

from __future__ import annotations

import time

from ... import faults, process
from ...config import CacheConfig
from ..engine.model import Decoder
from ..engine.parallel import TensorParallel
from ..engine.scheduler import Scheduler
from .admission import PrefetchGate
from .clock import RealTime, StepTime
from .driver import Simulation
from .options import RunOptions
from .parts import RunParts, abandon, engine, open_cache
from .replica_job import ReplicaFigures, phases, replica
from .replica_report import assemble, report
from .reporters import JobReporter
from .workload import generate

__all__ = ["run", "run_replicas", "solo"]


def run(cfg: CacheConfig, opts: RunOptions | None = None, comm=None) -> dict:
    """The whole job on every rank of ``comm`` (collective); returns the results."""
    if cfg.distributed.tp_size:
        return run_replicas(cfg, opts or RunOptions(), comm)
    sim = solo(cfg, opts or RunOptions(), comm)
    try:
        return sim.run()
    finally:
        sim.close()


def solo(cfg: CacheConfig, opts: RunOptions, comm=None, *, model: Decoder | None = None,
         realtime: bool = False, label: str | None = None) -> Simulation:
    """The main job's run on every rank of ``comm`` (collective): the whole trace, the
    model over every rank. ``model``: a model built already; ``realtime``: arrivals in
    seconds of real time (no bookkeeping replays), else in scheduler steps; ``label``:
    the configuration's name in a comparison (the results are then returned, not
    written)."""
    if opts.requests is not None:
        cfg = cfg.replace(workload={"requests": opts.requests})
    server, cache = open_cache(cfg, opts, comm)
    parts = None
    try:
        tp = TensorParallel.of(cfg, comm)
        try:
            w, trace = cfg.workload, generate(cfg.workload)
            gpu = cache.stats()["capacity_blocks"]["gpu"]
            # A request whose prefix must come from disk waits for its reads (agreed by the
            # ranks) instead of the step blocking on them: admission.PrefetchGate.
            gate = PrefetchGate(cache) if w.wait_for_disk_reads else None
            sched = Scheduler(trace, max_batch=w.max_batch, max_prefill_tokens=w.max_prefill_tokens,
                              gpu_blocks=gpu, tokens_per_block=cache.layout.tokens_per_block, gate=gate)
            placement, model = engine(cfg, cache, tp, comm, model)
            clock = RealTime(cache.device, tp) if realtime else StepTime(cache.device)
            ahead = w.run_ahead if w.run_ahead is not None else cache.device.type == "cuda"
            parts = RunParts(cache, tp, trace, sched, clock, model, placement, server, run_ahead=ahead,
                             gate=gate)
            faults.inject("run_setup", cache.rank)
            reporter = JobReporter(cfg, opts, parts, label=label)
        except BaseException:
            tp.free()
            raise
    except BaseException as e:
        abandon(cache, server, parts, e)
        raise
    return Simulation(cfg, opts, parts, reporter)


def run_replicas(cfg: CacheConfig, opts: RunOptions, comm=None) -> dict:
    """The replicated job on every rank (collective); returns the results everywhere.
    A job that is one replica (``tp_size`` = world size) is the plain main job."""
    if opts.requests is not None:
        cfg = cfg.replace(workload={"requests": opts.requests})
    world = TensorParallel.of(cfg, comm)
    # A replica that stopped on a signal never joins the next world collective: the
    # others, waiting in it, stop too (the stop request a replica posts ends the wait).
    world.stop_waiting_on_notice(lambda notices: process.decode_stop(max(notices, default=0)))
    try:
        if world.size <= cfg.distributed.tp_size:
            sim = solo(cfg, opts, comm)
            try:
                return sim.run()
            finally:
                sim.close()
        started = time.perf_counter()
        trace = generate(cfg.workload)
        parts: dict[str, ReplicaFigures] = {}
        for i, (phase, remote) in enumerate(phases(cfg)):
            sim = replica(cfg.replace(distributed={"remote": {"enabled": remote}}), opts, comm,
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
