"""The main job's loop: every rank runs the same seeded scheduler (SPMD) over the
trace, drives its own cache through the public API, runs its heads of the model
against the cache, and verifies what the cache hands back.

Per step: ``begin_step`` → the scheduler's plan (a replica's scheduler prefetches
arrivals here) → ``add_sequence`` for admitted prompts and ``append_tokens`` for
decodes, and ``prefetch`` for the requests next in line (their disk blocks start moving
into the host tier) → ``block_table`` → the model's forward pass through ``kv_pool`` (one
allreduce per layer) → check every reused block against its reference digest and a
sample of logits → ``end_step`` → ``release`` of finished requests. Every step the
ranks also confirm that they reused the same prefixes (their caches must decide
alike); every ``distributed.check_consistency_every`` steps the cache's own
``check_consistency()``.

Arrivals are counted in scheduler steps (``StepTime``, with bookkeeping replays of
GPU-only reuse and no reuse alongside), or in seconds of real time (``RealTime``:
``compare.run_compare`` serves the trace so, once per configuration)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ... import process
from ...cache import KVCache, create
from ...config import CacheConfig
from ...dtypes import torch_dtype
from ...errors import ConsistencyError, KVDistError
from ..engine.model import Decoder, Geometry, Segment, compute_dtype_for
from ..engine.parallel import TensorParallel
from ..engine.scheduler import Running, Scheduler, StepPlan
from .checks import CheckCounts, Verifier
from .clock import Latencies, RealTime, StepTime
from .integrity import BlockLedger
from .metrics import MetricsServer, Timeline, snapshot_from
from .placement import placements
from .plots import write_plots
from .preflight import StartupFailed, preflight
from .report import human_bytes, new_run_dir, point_latest, render, write_results
from .results import RunFacts, assemble
from .shadows import Shadows
from .workload import Trace, generate


@dataclass(slots=True)
class RunOptions:
    requests: int | None = None  # overrides workload.requests
    out: str | None = "runs"  # None: write no run directory
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"  # the interface the metrics endpoint listens on
    progress: bool = True
    compare: bool | None = None  # run in real time, once per configuration; None: on CUDA
    configs: tuple[str, ...] = ("all-tiers", "gpu-only", "no-reuse")  # compared (compare.CONFIGS)


# The cache calls of a step, each timed on its own (results: cache_calls_us_per_step).
CACHE_CALLS = ("begin_step", "add_sequence", "prefetch", "append_tokens", "block_table", "end_step",
               "release")


@dataclass(slots=True)
class _Clock:
    cache_api: float = 0.0  # the step outside the model's forward pass and the checks
    model: float = 0.0
    calls: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CACHE_CALLS, 0.0))
    started: float = field(default_factory=time.perf_counter)
    last_update: float = 0.0  # of the progress bar's figures


class Simulation:
    """One rank's part of the run. A job of several replicas runs one per replica
    (:mod:`kvdist.sim.experiment.replica_job` overrides the ``_make_*`` hooks and the reporting).
    ``model``: a model built already (``compare`` runs one for every configuration);
    ``realtime``: arrivals in seconds of real time (no bookkeeping replays), else in
    scheduler steps; ``label``: the configuration's name in a comparison (the results
    are then returned, not written)."""

    def __init__(self, cfg: CacheConfig, opts: RunOptions, comm=None, *, model: Decoder | None = None,
                 realtime: bool = False, label: str | None = None):
        self._given_model, self.realtime, self.label = model, realtime, label
        if opts.requests is not None:
            cfg = cfg.replace(workload={"requests": opts.requests})
        self.cfg, self.opts, self.comm = cfg, opts, comm
        self.w = cfg.workload
        self.server: MetricsServer | None = preflight(comm, opts.out, opts.metrics_port, opts.metrics_host)
        try:
            try:
                self.cache: KVCache = create(cfg, comm=comm)
            except KVDistError as e:
                raise StartupFailed(e) from e
            try:
                self.trace: Trace = self._make_trace()
                self.tp = self._make_tp()
            except BaseException:
                self.cache.close(wait_for_peers=False)
                raise
        except BaseException:
            if self.server is not None:
                self.server.close()
            raise
        self.rank0 = self.cache.rank == 0  # prints, reports, runs the replays
        self.shadows: Shadows | None = None
        self.timeline: Timeline | None = None
        self.stop: process.Interrupted | None = None  # a signal every rank agreed to stop on
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    # -- what a replica of several changes -------------------------------------------------------
    def _make_trace(self) -> Trace:
        return generate(self.w)

    def _make_tp(self) -> TensorParallel:
        """The model's tensor parallelism: every rank of the job."""
        return TensorParallel(self.comm)

    def _make_scheduler(self) -> Scheduler:
        return Scheduler(self.trace, max_batch=self.w.max_batch, max_prefill_tokens=self.w.max_prefill_tokens,
                         gpu_blocks=self.capacity["gpu"], tokens_per_block=self.cache.layout.tokens_per_block)

    def _setup_reporting(self) -> None:
        """Rank 0's replays (step time only), timeline and metrics endpoint."""
        if not self.rank0:
            return
        if not self.realtime:
            solo = None
            if self.tp.mpi is not None:  # the replays are this rank's alone
                from mpi4py import MPI

                solo = MPI.COMM_SELF
            self.shadows = Shadows(self.cfg, self.capacity["gpu"], self.w.priority, comm=solo)
        self.timeline = Timeline({t: self.capacity[t] for t in self.cache.tiers})

    def _before_step(self) -> None:
        """The scheduler keeps its own time: one step of the trace per step."""

    def _look_ahead(self) -> None:
        """After the step's admissions: start reading the disk blocks of the requests
        next in line into the host tier (``cache.prefetch``), so that their admission
        onboards from host memory instead of making the host wait for the disk. Once
        per request; the list is the scheduler's, alike on every rank."""
        for req in self.sched.upcoming():
            if req.rid not in self._prefetched:
                self._prefetched.add(req.rid)
                self.cache.prefetch(req.rid, req.prompt.tolist())

    def _after_step(self, plan: StepPlan, appends: list[tuple[int, int]], done: list[Running]) -> None:
        if self.shadows is not None:
            self.shadows.step([r.req for r in plan.prefills], appends, [r.req.rid for r in done])

    def _setup(self) -> None:
        cache, cfg = self.cache, self.cfg
        me_rank, self.placement = placements(cfg.cache.device, self.comm)
        me = self.placement[me_rank]
        assert me.device == str(cache.device), f"placement {me.device} but the cache is on {cache.device}"
        # On CPU the tiny model's matmuls are too small to gain from intra-op threads, and
        # threads of ranks sharing cores spin against each other (15x slower seen).
        cores = len(os.sched_getaffinity(0))
        torch.set_num_threads(1 if cache.device.type == "cpu" else max(1, cores // me.local_size))
        layout = cache.layout
        self.capacity = dict(cache.stats()["capacity_blocks"])
        self.sched = self._make_scheduler()
        self.model = self._given_model or Decoder(
            Geometry.from_config(cfg), seed=self.w.seed, tp=self.tp, device=cache.device,
            kv_dtype=torch_dtype(layout.dtype), tokens_per_block=layout.tokens_per_block,
            compute_dtype=compute_dtype_for(self.w.compute_dtype, cache.device))
        assert self.model.device == cache.device, f"model on {self.model.device}, cache on {cache.device}"
        if self._given_model is None and self.w.cuda_graphs and self.model.can_capture():
            self.model.capture_graphs()
        self.time = RealTime(cache.device, self.tp) if self.realtime else StepTime(cache.device)
        self.latency = Latencies()
        # Blocks another replica computed are checked against its writes at the end.
        self.ledger = BlockLedger(layout, cache.device, seed=self.w.seed, defer=cache.num_replicas > 1)
        self.verify = Verifier(cache, self.model, self.ledger, self.w.verify_logits_every)
        self.checks: CheckCounts = self.verify.counts
        self.tolerance = self.verify.tolerance
        self.clock = _Clock()
        self._prefetched: set[int] = set()  # requests whose disk blocks were looked ahead to
        self._setup_reporting()

    # -- one step --------------------------------------------------------------------------------
    def _step(self) -> list[int]:
        cache, w = self.cache, self.w
        self._before_step()
        now = self.time.now() if self.realtime else None  # rank 0's, on every rank
        t0 = time.perf_counter()
        cache.begin_step()
        calls = self.clock.calls
        calls["begin_step"] += time.perf_counter() - t0
        plan = self.sched.next_step(now)  # in the step: a prefetch may evict, like add_sequence
        if plan is None:  # real time: nothing arrived yet; close the step, wait for the next
            cache.end_step()
            self.time.sleep_until(self.sched.next_arrival())
            return []
        if not plan.batch:  # every runnable request waits for its prefetch: let the cache work
            cache.end_step()
            self.sched.complete(plan)
            os.sched_yield()  # ranks outnumber cores: the holders need the core more
            return []
        started = now or 0.0
        reused = []
        for run in plan.prefills:
            tokens = run.req.prompt.tolist()
            ta = time.perf_counter()
            reused.append(cache.add_sequence(run.req.rid, tokens, w.priority))
            calls["add_sequence"] += time.perf_counter() - ta
            self.ledger.admit(run.req.rid, run.req.prompt)
            self.latency.admitted(run.req, started)
        ta = time.perf_counter()
        self._look_ahead()
        tb = time.perf_counter()
        calls["prefetch"] += tb - ta
        appends = [(run.req.rid, int(run.req.output[run.generated - 1])) for run in plan.decodes]
        for rid, token in appends:
            cache.append_tokens(rid, [token])
        ta = time.perf_counter()
        calls["append_tokens"] += ta - tb
        table = cache.block_table([run.req.rid for run in plan.batch])
        t1 = time.perf_counter()
        calls["block_table"] += t1 - ta
        # One allreduce: the ranks reused alike, and whether any was asked to stop (a
        # signal): all then stop after this same step.
        same, stop = self.tp.agree([len(plan.batch), *reused], process.encode_stop(self.tp.rank))
        if not same:
            raise ConsistencyError(f"ranks reused different prefixes at step {plan.step}", [])
        self.stop = process.decode_stop(stop)
        out: list[tuple] = []
        self._on_compute_stream(lambda: out.append(self._forward(plan, table, reused)))
        self.time.sync()  # the step's first tokens are on the host
        t2 = time.perf_counter()
        computed = sum(len(r.req.prompt) for r in plan.prefills) - sum(reused)
        if computed:
            cache.observe_prefill(computed + len(plan.decodes), t2 - t1)
        done = self.sched.complete(plan)
        self._emitted(plan, done)
        with self.time.paused():  # verification costs no configuration any latency
            t_check = time.perf_counter()
            self._on_compute_stream(lambda: self._check(plan, table, reused, out[0]))
            paused = time.perf_counter() - t_check
        t3 = time.perf_counter()
        cache.end_step()
        ta = time.perf_counter()
        calls["end_step"] += ta - t3
        for run in done:
            cache.release(run.req.rid)
        t4 = time.perf_counter()
        calls["release"] += t4 - ta
        for run in done:
            self.ledger.release(run.req.rid)
        self.clock.cache_api += (t1 - t0) + (t4 - t3)
        self.clock.model += t2 - t1
        self.latency.busy_s += t4 - t0 - paused
        self._after_step(plan, appends, done)
        return [run.req.rid for run in done]

    def _emitted(self, plan: StepPlan, done: list[Running]) -> None:
        """Real time: every prefill of the step produced its first token now, ``done``
        their last."""
        if not self.realtime:
            return
        now, lat = self.time.local(), self.latency
        for run in plan.prefills:
            lat.first[run.req.rid] = now
        for run in done:
            lat.finish[run.req.rid] = now

    def _forward(self, plan: StepPlan, table: torch.Tensor, reused: list[int]) -> tuple:
        """The step's model work through the cache: (logits, K/V written, segments)."""
        segs = [Segment(i, n, run.req.prompt[n:]) for i, (run, n) in enumerate(zip(plan.prefills, reused))]
        for j, run in enumerate(plan.decodes):
            pos, g = len(run.req.prompt) + run.generated - 1, run.generated
            segs.append(Segment(len(plan.prefills) + j, pos, run.req.output[g - 1: g]))
        logits, written = self.model.forward_cached(self.cache, table, segs)
        return logits, written, segs

    def _check(self, plan: StepPlan, table: torch.Tensor, reused: list[int], out: tuple) -> None:
        """The reused blocks still hold what attention read (nothing writes them while
        their sequence holds them), so they are digested after the forward pass: a
        check before it would make every layer wait for every onboarded block. Then the
        ledger records what this step wrote (reusable from the next step on)."""
        logits, written, segs = out
        self.verify.reused_blocks(plan, table, reused)
        self.verify.logits(plan, reused, logits)
        base, offset = len(plan.prefills), 0
        for k, (seg, run) in enumerate(zip(segs, plan.batch)):
            n = len(seg.tokens)
            self.ledger.written(run.req.rid, seg.start, written[offset: offset + n],
                                appended=seg.tokens if k >= base else None)
            offset += n

    def _on_compute_stream(self, work) -> None:
        """Run ``work`` as the step's kernels. On CUDA and on a plain CPU cache it runs
        now, on the current stream. With simulated streams (``cache.simulate_async``) the
        block table and the onboarded blocks exist only once their queued copies ran, so
        the work is queued as a kernel on the simulated compute stream behind them and
        forced: reading them any earlier is the bug simulation exists to expose."""
        compute = self.cache.simulated_compute
        if compute is None:
            work()
        else:
            compute.force(compute.kernel(work))

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> dict:
        """Run every request to completion; returns the results (on every rank)."""
        if self.rank0:
            print(self._header(), flush=True)
        bar = tqdm(total=len(self.trace.requests), disable=not (self.rank0 and self.opts.progress),
                   unit="req", desc=self._progress_label(), dynamic_ncols=True, file=sys.stderr,
                   mininterval=0.2 if sys.stderr.isatty() else 5.0)
        if self.realtime:
            self.time.start()
        try:
            while not self.sched.done():
                try:
                    done = self._step()
                except ConsistencyError as e:  # every rank learns it at the same collective
                    self.checks.consistency_error = f"step {self.sched.step}: {e}"
                    break
                if self.stop is not None:  # every rank got the same value at the same step
                    raise self.stop
                if self.rank0:
                    self._progress(bar, done)
        finally:
            bar.close()
        self.cache.synchronize()
        self.checks.consistency_checks = self.cache.stats()["consistency_checks"]
        return self._results()

    def _progress_label(self) -> str:
        return f"kvdist run ({self.label})" if self.label else "kvdist run"

    def _progress(self, bar: tqdm, done: list[int]) -> None:
        """Rank 0 after every step: the timeline, the progress bar, the metrics."""
        stats = self.cache.stats()
        if self.timeline is not None:
            self.timeline.record(stats, self.shadows.reused()["gpu-only"] if self.shadows else None,
                                 self.sched.finished)
        bar.update(len(done))
        now = time.perf_counter()
        if now - self.clock.last_update > 0.5:
            self.clock.last_update = now
            prompt = max(stats["prompt_tokens"], 1)
            bar.set_postfix_str(f"reuse {100 * sum(stats['hit_tokens'].values()) / prompt:.0f}%, "
                                f"step {self.sched.step}", refresh=False)
            if self.server is not None:
                self.server.update(snapshot_from(stats, self.sched.finished, self.ledger.mismatched_blocks))

    # -- reporting -------------------------------------------------------------------------------
    def _header(self, trace: Trace | None = None) -> str:
        """What runs where, the cache and the trace (``trace``: the job's, when this
        rank's scheduler serves only a share of it)."""
        cache, w, lay = self.cache, self.w, self.cache.layout
        trace = self.trace if trace is None else trace
        bpb = lay.bytes_per_block
        nodes = len({p.node for p in self.placement})
        where = " ".join(f"{p.rank}->{p.device}" for p in self.placement)
        tiers = ", ".join(f"{t} {self.capacity[t]:,} blocks ({human_bytes(self.capacity[t] * bpb)})"
                          for t in cache.tiers if t in self.capacity)
        ws = trace.distinct_blocks(lay.tokens_per_block)
        self.working_set = ws
        m = self.model
        return "\n".join([
            f"kvdist run{f' [{self.label}]' if self.label else ''}: {cache.world_size} ranks on {nodes} "
            f"node(s), rank->device {where}",
            f"  cache per rank: {tiers}; block = {lay.tokens_per_block} tokens x {lay.num_layers} layers x "
            f"{lay.num_kv_heads} heads x {lay.head_dim} dims {lay.dtype} = {human_bytes(bpb)}",
            f"  trace: {len(trace.requests):,} requests, {w.conversations} live chats of "
            f"{w.turns[0]}-{w.turns[1]} turns over {w.system_prompts} system prompts of "
            f"{w.system_prompt_tokens} tokens; {trace.prompt_tokens:,} prompt tokens; working set "
            f"{ws:,} blocks = {ws / self.capacity['gpu']:.1f}x the GPU tier"
            + (f"; arrivals {w.request_rate:g} req/s (open loop, real time)" if self.realtime else ""),
            f"  model: {m.g.describe(self.tp.size)}; {str(m.cdt).removeprefix('torch.')} compute, "
            f"{m.attention.describe()} attention on {cache.device}"
            + (f", CUDA graphs for steps of up to {m.graphs.buckets[-1]} tokens" if m.graphs else ""),
        ])

    def _results(self) -> dict:
        s = self.cache.stats()
        keys = ("hit_tokens", "prompt_tokens", "bytes_offloaded", "bytes_onboarded", "bytes_demoted",
                "blocks_moved", "evictions_by_tier", "transfer_seconds", "bookkeeping_seconds",
                "host_wait_seconds", "host_wait_read_seconds", "host_waits_on_disk", "compute_wait_seconds",
                "fetch_policy", "transfer_path", "capacity_blocks", "block_bytes")
        led, c = self.ledger, self.checks
        t = s["transfer"]  # the CUDA executor's submission counters (absent elsewhere)
        mine = {"stats": {k: s[k] for k in keys} | {"copy_entries": t.get("copy_entries", 0),
                                                   "submit_seconds": t.get("submit_seconds", {})},
                "ledger": [led.checked_blocks, led.mismatched_blocks, led.unknown_blocks, led.variants,
                           led.first_mismatch],
                "clock": [self.clock.cache_api, self.clock.model],
                "calls": self.clock.calls,
                "logits": [c.logits_checked, c.logits_failed, c.logits_max_abs_diff]}
        everyone = self.tp.gather(mine)
        results = None
        if self.rank0:
            facts = RunFacts(
                world=self.tp.size, steps=self.sched.step, finished=self.sched.finished,
                complete=self.sched.done(), placement=[dataclasses.asdict(p) for p in self.placement],
                tiers=list(self.cache.tiers), requests_in_trace=len(self.trace.requests),
                shadow=self.shadows.reused() if self.shadows else None, working_set=self.working_set,
                tokens_per_block=self.cache.layout.tokens_per_block, tolerance=self.tolerance,
                checks=c, seconds=time.perf_counter() - self.clock.started, config=self.cfg.normalized(),
                latency=self.latency.summary() if self.realtime else None)
            results = assemble(facts, everyone)
            if self.label is None:
                self._write(results)
        return self.tp.bcast(results)

    def _write(self, results: dict) -> None:
        if self.opts.out is not None:
            run_dir = new_run_dir(self.opts.out)
            results["run_dir"] = str(run_dir)
            write_results(run_dir, results)
            (run_dir / "timeline.json").write_text(json.dumps(self.timeline.to_json()) + "\n")
            try:
                plots = [p.name for p in write_plots(run_dir, self.timeline, results["block_bytes"],
                                                     self.tp.size)]
            except ImportError:  # matplotlib is the optional `sim` extra
                plots = ["no plots: matplotlib is not installed"]
            point_latest(run_dir)
        print("\n" + render(results), flush=True)
        if self.opts.out is not None:
            print(f"results: {results['run_dir']}/results.json (+ timeline.json, {', '.join(plots)}); "
                  f"{Path(self.opts.out) / 'latest'} points there", flush=True)

    def close(self) -> None:
        """Free everything (collective: the cache's and the model's communicators)."""
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.shadows is not None:
            self.shadows.close()
            self.shadows = None
        try:
            self.cache.close()
        finally:
            self.tp.free()


def run(cfg: CacheConfig, opts: RunOptions | None = None, comm=None) -> dict:
    """The whole job on every rank of ``comm`` (collective); returns the results."""
    if cfg.distributed.tp_size:
        from .replica_job import run_replicas  # it builds on this module

        return run_replicas(cfg, opts or RunOptions(), comm)
    sim = Simulation(cfg, opts or RunOptions(), comm)
    try:
        return sim.run()
    finally:
        sim.close()
