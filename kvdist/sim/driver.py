"""The main job's loop: every rank runs the same seeded scheduler (SPMD) over the
trace, drives its own cache through the public API, runs its heads of the tiny
model against the cache, and verifies what the cache hands back.

Per step: ``begin_step`` → the scheduler's plan (a replica's scheduler prefetches
arrivals here) → ``add_sequence`` for admitted prompts and
``append_tokens`` for decodes → ``block_table`` → check every reused block against
its reference digest → the model's forward pass through ``kv_pool`` (one allreduce
per layer) → ``end_step`` → ``release`` of finished requests. Every step the ranks
also confirm that they reused the same prefixes (their caches must decide alike);
every ``distributed.check_consistency_every`` steps the cache's own ``check_consistency()``."""

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

from .. import process
from ..cache import KVCache, create
from ..config import CacheConfig
from ..dtypes import torch_dtype
from ..errors import ConsistencyError, KVDistError
from .integrity import BlockLedger
from .metrics import MetricsServer, Timeline, snapshot_from
from .model import Segment, TinyModel
from .parallel import TensorParallel
from .placement import placements
from .plots import write_plots
from .preflight import StartupFailed, preflight
from .report import human_bytes, new_run_dir, point_latest, render, write_results
from .scheduler import Running, Scheduler, StepPlan
from .shadows import Shadows
from .workload import Trace, generate


def logits_tolerance(kv_dtype: torch.dtype) -> float:
    """Relative tolerance of the reuse-vs-recompute logits check. Both paths see K/V
    rounded to the cache dtype, but float32 matmuls of different batch shapes may
    differ in the last bit, which can flip a rounding of a narrow K/V dtype."""
    bits = torch.finfo(kv_dtype).bits
    return 1e-4 if bits >= 32 else 2e-2 if bits >= 16 else 1e-1


@dataclass(slots=True)
class RunOptions:
    requests: int | None = None  # overrides workload.requests
    out: str | None = "runs"  # None: write no run directory
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"  # the interface the metrics endpoint listens on
    progress: bool = True


@dataclass(slots=True)
class _Checks:
    logits_checked: int = 0
    logits_failed: int = 0
    logits_max_abs_diff: float = 0.0
    consistency_checks: int = 0
    consistency_error: str | None = None
    prefills_with_reuse: int = 0  # prefills that reused something (the logits sample's clock)


@dataclass(slots=True)
class _Clock:
    cache_api: float = 0.0
    model: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    last_update: float = 0.0  # of the progress bar's figures


class Simulation:
    """One rank's part of the run. A job of several replicas runs one per replica
    (:mod:`kvdist.sim.replicas` overrides the ``_make_*`` hooks and the reporting)."""

    def __init__(self, cfg: CacheConfig, opts: RunOptions, comm=None):
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
        """Rank 0's replays, timeline and metrics endpoint."""
        if not self.rank0:
            return
        solo = None
        if self.tp.mpi is not None:  # the replays are this rank's alone
            from mpi4py import MPI

            solo = MPI.COMM_SELF
        self.shadows = Shadows(self.cfg, self.capacity["gpu"], self.w.priority, comm=solo)
        self.timeline = Timeline({t: self.capacity[t] for t in self.cache.tiers})

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
        self.kv_dtype = torch_dtype(layout.dtype)
        self.capacity = dict(cache.stats()["capacity_blocks"])
        self.sched = self._make_scheduler()
        self.model = TinyModel(layers=layout.num_layers, heads=layout.num_kv_heads, head_dim=layout.head_dim,
                               hidden=self.w.hidden, vocab=self.w.vocab_size, seed=self.w.seed, tp=self.tp,
                               device=cache.device, kv_dtype=self.kv_dtype,
                               tokens_per_block=layout.tokens_per_block)
        # Blocks another replica computed are checked against its writes at the end.
        self.ledger = BlockLedger(layout, cache.device, seed=self.w.seed, defer=cache.num_replicas > 1)
        self.tolerance = logits_tolerance(self.kv_dtype)
        self.checks = _Checks()
        self.clock = _Clock()
        self._setup_reporting()

    # -- one step --------------------------------------------------------------------------------
    def _step(self) -> list[int]:
        cache, w = self.cache, self.w
        t0 = time.perf_counter()
        cache.begin_step()
        plan = self.sched.next_step()  # in the step: a prefetch may evict, like add_sequence
        if not plan.batch:  # every runnable request waits for its prefetch: let the cache work
            cache.end_step()
            self.sched.complete(plan)
            os.sched_yield()  # ranks outnumber cores: the holders need the core more
            return []
        reused = []
        for run in plan.prefills:
            reused.append(cache.add_sequence(run.req.rid, run.req.prompt.tolist(), w.priority))
            self.ledger.admit(run.req.rid, run.req.prompt)
        appends = [(run.req.rid, int(run.req.output[run.generated - 1])) for run in plan.decodes]
        for rid, token in appends:
            cache.append_tokens(rid, [token])
        table = cache.block_table([run.req.rid for run in plan.batch])
        t1 = time.perf_counter()
        # One allreduce: the ranks reused alike, and whether any was asked to stop (a
        # signal): all then stop after this same step.
        same, stop = self.tp.agree([len(plan.batch), *reused], process.encode_stop(self.tp.rank))
        if not same:
            raise ConsistencyError(f"ranks reused different prefixes at step {plan.step}", [])
        self.stop = process.decode_stop(stop)
        self._on_compute_stream(lambda: self._compute(plan, table, reused))
        t2 = time.perf_counter()
        cache.end_step()
        done = self.sched.complete(plan)
        for run in done:
            cache.release(run.req.rid)
            self.ledger.release(run.req.rid)
        t3 = time.perf_counter()
        self.clock.cache_api += (t1 - t0) + (t3 - t2)
        self.clock.model += t2 - t1
        self._after_step(plan, appends, done)
        return [run.req.rid for run in done]

    def _compute(self, plan: StepPlan, table: torch.Tensor, reused: list[int]) -> None:
        """The step's device work: check the reused blocks, run the model through the
        cache, record what it wrote, check the sampled logits."""
        self._check_reused(plan, table, reused)
        segs = [Segment(i, n, run.req.prompt[n:]) for i, (run, n) in enumerate(zip(plan.prefills, reused))]
        base = len(plan.prefills)
        for j, run in enumerate(plan.decodes):
            pos = len(run.req.prompt) + run.generated - 1
            segs.append(Segment(base + j, pos, run.req.output[run.generated - 1: run.generated]))
        logits, written = self.model.forward_cached(self.cache, table, segs)
        offset = 0
        for k, (seg, run) in enumerate(zip(segs, plan.batch)):
            n = len(seg.tokens)
            self.ledger.written(run.req.rid, seg.start, written[offset: offset + n],
                                appended=seg.tokens if k >= base else None)
            offset += n
        self._check_logits(plan, reused, logits)

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

    # -- the checks ------------------------------------------------------------------------------
    def _check_reused(self, plan: StepPlan, table: torch.Tensor, reused: list[int]) -> None:
        """Digest every reused block as the cache hands it back (one gather per layer
        for the whole step) and compare with the reference of what was written."""
        tpb = self.cache.layout.tokens_per_block
        picks = [(i, n // tpb) for i, n in enumerate(reused) if n]
        if not picks:
            return
        rows = torch.cat([table[i, :nb] for i, nb in picks]).long()
        blocks = torch.stack([self.cache.kv_pool(layer)[rows] for layer in range(self.model.L)], dim=1)
        digests = self.ledger.digest(blocks)
        at = 0
        for i, nb in picks:
            self.ledger.check_reused(plan.prefills[i].req.rid, digests[at: at + nb])
            at += nb

    def _check_logits(self, plan: StepPlan, reused: list[int], logits: torch.Tensor) -> None:
        """For every ``verify_logits_every``-th request that reused a prefix, the first
        generated token's logits must equal a from-scratch recompute's (collective: the
        ranks agreed on ``reused`` this step, so all pick the same requests)."""
        every = self.w.verify_logits_every
        if not every:
            return
        for i, n in enumerate(reused):
            if not n:
                continue
            self.checks.prefills_with_reuse += 1
            if (self.checks.prefills_with_reuse - 1) % every:
                continue
            ref = self.model.forward_dense(plan.prefills[i].req.prompt)
            diff = float((logits[i] - ref).abs().max())
            scale = max(1.0, float(ref.abs().max()))
            c = self.checks
            c.logits_checked += 1
            c.logits_failed += diff > self.tolerance * scale
            c.logits_max_abs_diff = max(c.logits_max_abs_diff, diff)

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> dict:
        """Run every request to completion; returns the results (on every rank)."""
        if self.rank0:
            print(self._header(), flush=True)
        bar = tqdm(total=len(self.trace.requests), disable=not (self.rank0 and self.opts.progress),
                   unit="req", desc=self._progress_label(), dynamic_ncols=True, file=sys.stderr,
                   mininterval=0.2 if sys.stderr.isatty() else 5.0)
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
        return "kvdist run"

    def _progress(self, bar: tqdm, done: list[int]) -> None:
        """Rank 0 after every step: the timeline, the progress bar, the metrics."""
        stats = self.cache.stats()
        if self.timeline is not None:
            self.timeline.record(stats, self.shadows.reused()["gpu-only"], self.sched.finished)
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
        heads = lay.num_kv_heads
        return "\n".join([
            f"kvdist run: {cache.world_size} ranks on {nodes} node(s), rank->device {where}",
            f"  cache per rank: {tiers}; block = {lay.tokens_per_block} tokens x {lay.num_layers} layers x "
            f"{heads} heads x {lay.head_dim} dims {lay.dtype} = {human_bytes(bpb)}",
            f"  trace: {len(trace.requests):,} requests, {w.conversations} live chats of "
            f"{w.turns[0]}-{w.turns[1]} turns over {w.system_prompts} system prompts of "
            f"{w.system_prompt_tokens} tokens; {trace.prompt_tokens:,} prompt tokens; working set "
            f"{ws:,} blocks = {ws / self.capacity['gpu']:.1f}x the GPU tier",
            f"  model: {lay.num_layers} layers, {heads * self.tp.size} heads ({heads} per rank) x "
            f"{lay.head_dim}, hidden {w.hidden}, vocab {w.vocab_size}; float32 compute on {cache.device}",
        ])

    def _results(self) -> dict:
        s = self.cache.stats()
        keys = ("hit_tokens", "prompt_tokens", "bytes_offloaded", "bytes_onboarded", "bytes_demoted",
                "blocks_moved", "evictions_by_tier", "transfer_seconds", "bookkeeping_seconds",
                "host_wait_seconds", "host_waits_on_disk",
                "transfer_path", "capacity_blocks", "block_bytes")
        led, c = self.ledger, self.checks
        mine = {"stats": {k: s[k] for k in keys},
                "ledger": [led.checked_blocks, led.mismatched_blocks, led.unknown_blocks, led.variants,
                           led.first_mismatch],
                "clock": [self.clock.cache_api, self.clock.model],
                "logits": [c.logits_checked, c.logits_failed, c.logits_max_abs_diff]}
        everyone = self.tp.gather(mine)
        results = None
        if self.rank0:
            results = self._assemble(everyone)
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
        return self.tp.bcast(results)

    def _assemble(self, everyone: list[dict]) -> dict:
        world, steps = self.tp.size, max(self.sched.step, 1)
        first = everyone[0]["stats"]
        prompt = first["prompt_tokens"]
        reused = dict(first["hit_tokens"])
        shadow = self.shadows.reused()
        computed = {"this run": prompt - sum(reused.values()), "gpu-only": prompt - shadow["gpu-only"],
                    "no reuse": prompt - shadow["no reuse"]}
        moved = sum(e["stats"][k] for e in everyone
                    for k in ("bytes_offloaded", "bytes_onboarded", "bytes_demoted"))
        seconds_moving = sum(e["stats"]["transfer_seconds"] for e in everyone)
        ledgers = [e["ledger"] for e in everyone]
        logits = [e["logits"] for e in everyone]
        mismatches = sum(x[1] for x in ledgers)
        integrity = {
            "blocks_checked": sum(x[0] for x in ledgers),
            "tokens_checked": sum(x[0] for x in ledgers) * self.cache.layout.tokens_per_block,
            "mismatched_blocks": mismatches,
            "unknown_blocks": sum(x[2] for x in ledgers),
            "recomputed_variants": sum(x[3] for x in ledgers),
            "first_mismatch": next((x[4] for x in ledgers if x[4]), None),
            "logits_checked": logits[0][0],
            "logits_failed": max(x[1] for x in logits),
            "logits_max_abs_diff": max(x[2] for x in logits),
            "logits_tolerance": self.tolerance,
            "consistency": {"checks": self.checks.consistency_checks, "error": self.checks.consistency_error},
        }
        ok = (mismatches == 0 and integrity["logits_failed"] == 0 and self.checks.consistency_error is None
              and self.sched.done())
        return {
            "ok": ok,
            "world_size": world,
            "nodes": len({p.node for p in self.placement}),
            "placement": [dataclasses.asdict(p) for p in self.placement],
            "device": ",".join(sorted({p.device for p in self.placement})),
            "tiers": list(self.cache.tiers),
            "requests": self.sched.finished,
            "requests_in_trace": len(self.trace.requests),
            "prompt_tokens": prompt,
            "reused_tokens": reused,
            "reused_tokens_gpu_only": shadow["gpu-only"],
            "prefill_tokens_computed": computed,
            "prefill_tokens_saved": {"vs no reuse": computed["no reuse"] - computed["this run"],
                                     "vs gpu-only": computed["gpu-only"] - computed["this run"]},
            "working_set_blocks": self.working_set,
            "capacity_blocks": first["capacity_blocks"],
            "block_bytes": first["block_bytes"],
            "evictions_by_tier": first["evictions_by_tier"],
            "blocks_moved_per_rank": first["blocks_moved"],
            "bytes_offloaded": sum(e["stats"]["bytes_offloaded"] for e in everyone),
            "bytes_onboarded": sum(e["stats"]["bytes_onboarded"] for e in everyone),
            "bytes_demoted": sum(e["stats"]["bytes_demoted"] for e in everyone),
            "transfer_path": first["transfer_path"],
            "transfer_gb_per_s": moved / seconds_moving / 1e9 if seconds_moving else 0.0,
            "bookkeeping_us_per_step": 1e6 * sum(e["stats"]["bookkeeping_seconds"] for e in everyone)
            / world / steps,
            "host_wait_us_per_step": 1e6 * sum(e["stats"]["host_wait_seconds"] for e in everyone)
            / world / steps,
            "host_waits_on_disk": sum(e["stats"]["host_waits_on_disk"] for e in everyone),
            "cache_api_us_per_step": 1e6 * sum(e["clock"][0] for e in everyone) / world / steps,
            "model_ms_per_step": 1e3 * sum(e["clock"][1] for e in everyone) / world / steps,
            "integrity_mismatches": mismatches,
            "integrity": integrity,
            "steps": self.sched.step,
            "seconds": time.perf_counter() - self.clock.started,
            "config": self.cfg.normalized(),
        }

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
        from .replicas import run_replicas  # it builds on this module

        return run_replicas(cfg, opts or RunOptions(), comm)
    sim = Simulation(cfg, opts or RunOptions(), comm)
    try:
        return sim.run()
    finally:
        sim.close()
