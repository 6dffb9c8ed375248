"""The main job's reporter (``driver.Reporter``): rank 0's bookkeeping replays of the
same steps (GPU-only reuse, no reuse: step-counted runs only), the timeline, the header
and the results (``results.assemble``), printed and written to ``runs/<UTC time>/``
unless the run is one configuration of a comparison (``label``)."""

from __future__ import annotations

import dataclasses
import time

from ...config import CacheConfig
from ..engine.scheduler import Running, StepPlan
from .driver import Simulation
from .metrics import Timeline
from .options import RunOptions
from .parts import RunParts
from .plots import write_plots
from .report import human_bytes, publish, render
from .results import RankFigures, RunFacts, assemble
from .shadows import Shadows
from .workload import Trace

__all__ = ["JobReporter", "describe"]


class JobReporter:
    """The main job's reporting on one rank (replays and timeline on rank 0)."""

    def __init__(self, cfg: CacheConfig, opts: RunOptions, parts: RunParts, *, label: str | None = None):
        self.cfg, self.opts, self.tp, self.name = cfg, opts, parts.tp, label
        self.label = f"kvdist run ({label})" if label else "kvdist run"
        self.working_set = 0
        self.shadows: Shadows | None = None
        self.timeline: Timeline | None = None
        cache = parts.cache
        if cache.rank != 0:
            return
        capacity = cache.stats()["capacity_blocks"]
        if not parts.clock.realtime:
            solo = None
            if self.tp.mpi is not None:  # the replays are this rank's alone
                from mpi4py import MPI

                solo = MPI.COMM_SELF
            self.shadows = Shadows(cfg, capacity["gpu"], cfg.workload.priority, comm=solo)
        self.timeline = Timeline({t: capacity[t] for t in cache.tiers})

    def header(self, sim: Simulation) -> str:
        text, self.working_set = describe(sim, sim.trace, self.name)
        return text

    def step(self, plan: StepPlan, appends: list[tuple[int, int]], done: list[Running]) -> None:
        if self.shadows is not None:
            self.shadows.step([r.req for r in plan.prefills], appends, [r.req.rid for r in done])

    def progress(self, stats: dict, finished: int) -> None:
        if self.timeline is not None:
            self.timeline.record(stats, self.shadows.reused()["gpu-only"] if self.shadows else None, finished)

    def results(self, sim: Simulation) -> dict:
        sched, cache = sim.sched, sim.cache
        mine = RankFigures.collect(cache, requests=len(sim.trace.requests), finished=sched.finished,
                                   steps=sched.step, ledger=sim.ledger, checks=sim.checks, times=sim.times,
                                   tolerance=sim.tolerance)
        everyone = self.tp.gather(mine)
        results = None
        if cache.rank == 0:
            facts = RunFacts(
                world=self.tp.size, steps=sched.step, finished=sched.finished, complete=sched.done(),
                placement=[dataclasses.asdict(p) for p in sim.placement], tiers=list(cache.tiers),
                requests_in_trace=len(sim.trace.requests),
                shadow=self.shadows.reused() if self.shadows else None,
                working_set=self.working_set, tokens_per_block=cache.layout.tokens_per_block,
                tolerance=sim.tolerance, checks=sim.checks, seconds=time.perf_counter() - sim.times.started,
                config=self.cfg.normalized(), latency=sim.latency.summary() if sim.realtime else None,
                run_ahead=sim.parts.run_ahead)
            results = assemble(facts, everyone)
            if self.name is None:
                self._write(results)
        return self.tp.bcast(results)

    def _write(self, results: dict) -> None:
        def extras(run_dir) -> list[str]:
            import json

            (run_dir / "timeline.json").write_text(json.dumps(self.timeline.to_json()) + "\n",
                encoding="utf-8")
            try:
                return ["timeline.json"] + [p.name for p in write_plots(run_dir, self.timeline,
                                                                        results["block_bytes"], self.tp.size)]
            except ImportError:  # matplotlib is the optional `sim` extra
                return ["timeline.json", "no plots: matplotlib is not installed"]

        publish(results, self.opts.out, render, extras)

    def close(self) -> None:
        if self.shadows is not None:
            self.shadows.close()
            self.shadows = None


def describe(sim: Simulation, trace: Trace, label: str | None = None) -> tuple[str, int]:
    """What runs where, the cache and the trace (``trace``: the job's, when this
    rank's scheduler serves only a share of it); and the trace's working set in blocks."""
    cache, w, lay, capacity = sim.cache, sim.w, sim.cache.layout, sim.capacity
    bpb = lay.bytes_per_block
    nodes = len({p.node for p in sim.placement})
    where = " ".join(f"{p.rank}->{p.device}" for p in sim.placement)
    tiers = ", ".join(f"{t} {capacity[t]:,} blocks ({human_bytes(capacity[t] * bpb)})"
                      for t in cache.tiers if t in capacity)
    ws = trace.distinct_blocks(lay.tokens_per_block)
    m = sim.model
    return "\n".join([
        f"kvdist run{f' [{label}]' if label else ''}: {cache.world_size} ranks on {nodes} "
        f"node(s), rank->device {where}",
        f"  cache per rank: {tiers}; block = {lay.tokens_per_block} tokens x {lay.num_layers} layers x "
        f"{lay.num_kv_heads} heads x {lay.head_dim} dims {lay.dtype} = {human_bytes(bpb)}",
        f"  trace: {len(trace.requests):,} requests, {w.conversations} live chats of "
        f"{w.turns[0]}-{w.turns[1]} turns over {w.system_prompts} system prompts of "
        f"{w.system_prompt_tokens} tokens; {trace.prompt_tokens:,} prompt tokens; working set "
        f"{ws:,} blocks = {ws / capacity['gpu']:.1f}x the GPU tier"
        + (f"; arrivals {w.request_rate:g} req/s (open loop, real time)" if sim.realtime else ""),
        f"  model: {m.g.describe(sim.tp.size)}; {str(m.cdt).removeprefix('torch.')} compute, "
        f"{m.attention.describe()} attention on {cache.device}"
        + (f", CUDA graphs for steps of up to {m.graphs.buckets[-1]} tokens" if m.graphs else ""),
    ]), ws
