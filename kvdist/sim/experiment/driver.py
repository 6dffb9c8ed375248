"""The main job's step loop: every rank runs the same seeded scheduler (SPMD) over the
trace, drives its own cache through the public API, runs its heads of the model
against the cache, and verifies what the cache hands back.

``Simulation`` is composed of its parts (``parts.RunParts``: the cache, the model's tensor
parallelism, the trace, the scheduler, the clock, the model) and a ``Reporter``; the
main job (``solo``) and a replica of several (``replica_job``) build different parts
around the same loop. A step is schedule → run → postprocess (nano-vllm's shape):

- ``_schedule``: ``begin_step`` → the scheduler's plan (its gate, ``admission.PrefetchGate``,
  prefetches the runnable requests whose GPU blocks it reserves, and admits only those
  whose prefetch ``cache.prefetch_ready`` says has landed: a request whose prefix must
  come from disk waits a step or more for its reads, agreed by the ranks, and the step
  never blocks on them) → ``add_sequence`` for admitted prompts, ``prefetch`` for the
  requests next in line (their disk blocks start moving into the host tier early),
  ``append_tokens`` for decodes → ``block_table``;
- ``_run``: the ranks agree (they reused the same prefixes; whether one was asked to
  stop) → the model's forward pass through ``kv_pool`` (one allreduce per layer) →
  the step's first tokens on the host;
- ``_postprocess``: the scheduler completes the plan → check every reused block
  against its reference digest and a sample of logits (the clock paused) →
  ``end_step`` → ``release`` of finished requests → the reporter's record.

Running ahead, the host waits for nothing but a step's first tokens: the digests of
the blocks a step reused and wrote are queued behind its pass and compared a step or
more later, once they are on the host (``readback.Readback``: event-polled, exact, in
step order); their device time is left out of the clock and the timed figures. Only
a step with a logits recompute due pauses (and synchronizes) as the serial loop does.

Time is measured around the step, not inside it: the cache calls through
``timing.TimedCache``, the phases by ``timing.StepTimes``. Every
``distributed.check_consistency_every`` steps the cache runs its own
``check_consistency()``.

Arrivals are counted in scheduler steps (``StepTime``, with bookkeeping replays of
GPU-only reuse and no reuse alongside), in seconds of real time (``RealTime``:
``compare.run_compare`` serves the trace so, once per configuration), or by the wall
clock in steps of ``workload.step_ms`` (``WallSteps``: replicas)."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch
from tqdm import tqdm

from ... import process
from ...config import CacheConfig
from ...errors import ConsistencyError
from ..engine.scheduler import Running, StepPlan
from .admission import PrefetchGate
from .checks import CheckCounts, Verifier
from .clock import Latencies
from .forward import InFlight, launch, wait
from .integrity import BlockLedger
from .metrics import snapshot_from
from .options import RunOptions
from .parts import RunParts, close_parts
from .readback import Readback, queue_step
from .timing import CACHE_CALLS, StepTimes, TimedCache

__all__ = ["CACHE_CALLS", "Reporter", "Simulation"]


@dataclass(slots=True)
class _Prepared:
    """A step scheduled: its plan, what its prefills reused, its block table."""

    plan: StepPlan
    reused: list[int]
    table: torch.Tensor
    t0: float  # perf_counter at its begin_step
    t1: float  # ... once its block table was staged
    appends: list[tuple[int, int]]  # (request id, decoded token) of its decodes


@dataclass(slots=True)
class _Flying:
    """A step launched, running ahead: closed (``end_step``, its finished requests
    released) but not yet waited for."""

    step: _Prepared
    flight: InFlight
    done: list[Running]  # its finished requests
    t_launch: float
    start: float  # its window's start: the previous step's first tokens, or its own begin_step
    prev: InFlight | None  # the pass it was queued behind
    late: bool  # that pass had ended before this step was queued (the GPU waited for the host)


R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class Reporter(Protocol[R_co]):
    """What a run reports: its header, every step's record, and its results."""

    label: str  # the progress bar's

    def header(self, sim: Simulation) -> str:
        """Rank 0's lines before the run."""
        ...

    def step(self, plan: StepPlan, appends: list[tuple[int, int]], done: list[Running]) -> None:
        """After every step that ran a batch (every rank)."""
        ...

    def progress(self, stats: dict, finished: int) -> None:
        """Rank 0 after every step."""
        ...

    def results(self, sim: Simulation) -> R_co:
        """The run's results (collective; every rank)."""
        ...

    def close(self) -> None: ...


class Simulation(Generic[R]):
    """One rank's part of one run: the step loop over ``parts``, reported by
    ``reporter``. ``realtime``: latencies are recorded (first and last tokens)."""

    def __init__(self, cfg: CacheConfig, opts: RunOptions, parts: RunParts, reporter: Reporter[R]):
        self.cfg, self.opts, self.w = cfg, opts, cfg.workload
        self.parts, self.reporter = parts, reporter
        self.cache, self.tp, self.trace, self.sched = parts.cache, parts.tp, parts.trace, parts.sched
        self.time, self.model, self.placement = parts.clock, parts.model, parts.placement
        self.realtime = self.time.realtime
        self.rank0 = self.cache.rank == 0  # prints, reports, runs the replays
        self.capacity = dict(self.cache.stats()["capacity_blocks"])
        self.latency = Latencies()
        # Blocks another replica computed are checked against its writes at the end.
        self.ledger = BlockLedger(self.cache.layout, self.cache.device, seed=self.w.seed,
                                  defer=self.cache.num_replicas > 1)
        self.verify = Verifier(self.cache, self.model, self.ledger, self.w.verify_logits_every)
        self.readback = Readback(self.ledger)  # digests queued on the device, compared later
        self._checks_s = 0.0  # their device time, read back, not yet left out of a step's figures
        self.checks: CheckCounts = self.verify.counts
        self.tolerance = self.verify.tolerance
        self.times = StepTimes()
        self.calls = TimedCache(self.cache, self.times)
        self.stop: process.Interrupted | None = None  # a signal every rank agreed to stop on
        # The look-ahead's prefetches go through the scheduler's gate when it has one (each
        # request once), timed as the step's "prefetch" call either way.
        self.gate = parts.gate if parts.gate is not None else PrefetchGate(self.calls)
        self.gate.cache = self.calls
        self._last_update = 0.0  # of the progress bar's figures
        compute = self.cache.simulated_compute
        if parts.run_ahead and compute is not None:  # tables, too, wait on the stream like the passes
            compute.runs_behind = True

    # -- one step: schedule -> run -> postprocess -----------------------------------------------
    def _prepare(self, *, wait: bool = True) -> _Prepared | None:
        """Schedule the next step: ``begin_step``, the plan, the cache calls before the
        forward pass. None when there is nothing to run (the step is closed; ``wait``:
        in real time with nothing arrived, sleep until the next arrival first)."""
        self._poll()
        t_idle = time.perf_counter()
        now = self.time.before_step(self.sched)  # rank 0's real time on every rank, or None
        t0 = time.perf_counter()
        self.times.idle += t0 - t_idle
        self.calls.begin_step()
        plan = self.sched.next_step(now)  # in the step: a prefetch may evict, like add_sequence
        if plan is None or not plan.batch:
            self.cache.end_step()
            if plan is not None:  # every runnable request waits for its prefetch: let the cache work
                self.sched.complete(plan)
                os.sched_yield()  # ranks outnumber cores: the holders need the core more
            elif wait:
                self.time.sleep_until(self.sched.next_arrival())
            self.times.idle += time.perf_counter() - t0
            return None
        appends = _appends(plan)  # before the plan completes: each decode's token now
        reused, table = self._schedule(plan, appends, now or 0.0)
        t1 = time.perf_counter()
        self.times.cache_api += t1 - t0
        return _Prepared(plan, reused, table, t0, t1, appends)

    def _schedule(self, plan: StepPlan, appends: list[tuple[int, int]], started: float
                  ) -> tuple[list[int], torch.Tensor]:
        """The step's cache calls before the forward pass: admissions, look-ahead,
        appends, the block table. Returns the tokens each prefill reused and the table."""
        reused = []
        for run in plan.prefills:
            reused.append(self.calls.add_sequence(run.req.rid, run.req.prompt.tolist(), self.w.priority))
            self.ledger.admit(run.req.rid, run.req.prompt)
            self.latency.admitted(run.req, started)
        if self.parts.look_ahead:
            # The requests next in line: their disk blocks start moving into the host tier
            # now, so that their admission onboards from host memory whose reads are done.
            # Once per request; the list is the scheduler's, alike on every rank.
            for req in self.sched.upcoming():
                self.gate.prefetch(req)
        self.calls.append_tokens(appends)
        return reused, self.calls.block_table([run.req.rid for run in plan.batch])

    def _launch(self, step: _Prepared, *, ahead: bool) -> InFlight:
        """The ranks agree (one allreduce: they reused alike, and whether any was asked
        to stop by a signal: all then stop after this same step), then the forward pass
        is queued (``ahead``: with the digests of its reused blocks behind it)."""
        world = self.parts.world
        request = process.encode_stop(self.cache.rank)  # a signal, named by its world rank
        if world is not None:  # another replica's stop counts as this rank's own
            request = max([request, *world.take_notices()])
        same, stop = self.tp.agree([len(step.plan.batch), *step.reused], request,
                                   f"step {step.plan.step:,}'s agreement")
        if not same:
            raise ConsistencyError(f"ranks reused different prefixes at step {step.plan.step}", [])
        self.stop = process.decode_stop(stop)
        if self.stop is not None and world is not None:
            world.notify_all(stop)  # the other replicas stop at their next step
        return launch(self.cache, self.model, step.plan, step.table, step.reused, self.ledger, digest=ahead)

    def _release(self, done: list[Running]) -> float:
        """Close the step and release its finished requests; returns the time it took."""
        t0 = time.perf_counter()
        self.calls.end_step()
        self.calls.release([run.req.rid for run in done])
        took = time.perf_counter() - t0
        self.times.cache_api += took
        return took

    def _poll(self) -> None:
        """Compare the queued digests that reached the host (never waits); their device
        time leaves the clock now and the next step's figures."""
        took = self.readback.poll()
        self.time.add_pause(took)
        self._checks_s += took

    def _take_checks(self) -> float:
        took, self._checks_s = self._checks_s, 0.0
        return took

    def _finish(self, flight: InFlight, step: _Prepared, done: list[Running], since: float, *,
                ahead: bool) -> float:
        """The step's first tokens are on the host (the host waited for them since
        ``since``): its figures, then the checks of what the cache handed back
        (serially, or with a logits recompute due: the clock paused; else queued behind
        the pass and compared later), the reporter's record. Returns the pause."""
        plan = flight.plan
        ready = time.perf_counter()
        self.times.model += ready - since
        busy = flight.device_seconds()
        self.times.gpu_busy += busy
        computed = sum(len(r.req.prompt) for r in plan.prefills) - sum(flight.reused)
        if computed:  # run ahead, the host's wait also covers the next step's preparation
            self.cache.observe_prefill(computed + len(plan.decodes), busy if ahead else ready - since)
        if ahead:
            self.readback.add(flight.digests[0])
            self._poll()  # the digests that ran before this pass leave the clock before its first tokens
        self._emitted(plan, done)
        paused = 0.0
        if not ahead or self.verify.logits_due(flight.reused):
            with self.time.paused():  # verification costs no configuration any latency
                t_check = time.perf_counter()
                if ahead:  # the device is synchronized: every queued digest is on the host
                    drained = self.readback.drain()
                    self.verify.logits(plan, flight.reused, flight.result[0])
                else:
                    self._on_compute_stream(lambda: self._check(flight))
                paused = time.perf_counter() - t_check
            if ahead:  # the pause's start waited for them on the device: out of the clock too
                self.time.add_pause(drained)
        else:  # no recompute due: the sample's count moves on, nothing waits
            self.verify.logits(plan, flight.reused, flight.result[0])
        for run in done:
            self.ledger.release(run.req.rid)
        self.reporter.step(plan, step.appends, done)
        flight.out.clear()  # its logits and K/V written (GiBs after a long prefill): not held past here
        return paused

    def _step(self) -> list[int]:
        """One step, serial: the host prepares it, then waits for its forward pass."""
        step = self._prepare()
        if step is None:
            return []
        t_launch = time.perf_counter()
        flight = self._launch(step, ahead=False)
        wait(self.cache, flight, self.time.sync)  # the step's first tokens are on the host
        done = self.sched.complete(step.plan)
        paused = self._finish(flight, step, done, t_launch, ahead=False)
        released = self._release(done)
        end = time.perf_counter()
        # The GPU waits for all of the step's cache work.
        self.times.count(end - step.t0 - paused, step.t1 - step.t0 + released)
        self.latency.busy_s += end - step.t0 - paused
        return [run.req.rid for run in done]

    def _fly(self, step: _Prepared, start: float, prev: _Flying | None, late: bool | None = None) -> _Flying:
        """Launch a prepared step (behind ``prev``'s pass, if one is in flight), complete
        its plan and close it: ``end_step``, release of its finished requests. ``late``:
        whether the GPU waited for its preparation (default: whether ``prev``'s pass had
        ended by now, an event query that never waits)."""
        if late is None:
            late = prev is not None and prev.flight.ended()
        t_launch = time.perf_counter()
        flight = self._launch(step, ahead=True)
        done = self.sched.complete(step.plan)
        self._release(done)
        return _Flying(step, flight, done, t_launch, start, prev.flight if prev is not None else None, late)

    def _step_ahead(self, cur: _Flying | None) -> tuple[list[int], _Flying | None]:
        """Step N running ahead (``cur``; None: nothing is in flight, N is prepared and
        launched now). The host prepares step N+1 — admissions and prefetches, appends,
        ``block_table`` staged under S3 — and queues its pass behind N's (decode tokens
        come from the trace: N+1 needs nothing N computes), and only then waits for N's
        first tokens; N's checks and records are done while N+1 runs. Returns N's
        finished requests and step N+1 in flight (None: none)."""
        if cur is None:
            step = self._prepare()
            if step is None:
                return [], None
            cur = self._fly(step, step.t0, None)
        step = None if self.sched.done() else self._prepare(wait=False)
        # A logits recompute due for N pauses (and synchronizes) after N: N+1 waits, prepared.
        due = self.verify.logits_due(cur.flight.reused)
        nxt = self._fly(step, 0.0, cur) if step is not None and not due else None
        wait(self.cache, cur.flight)
        ready = time.perf_counter()
        self._finish(cur.flight, cur.step, cur.done, max(cur.t_launch, cur.start), ahead=True)
        if step is not None and due:  # the GPU waited for the pause, not the cache: its window opens now
            nxt = self._fly(step, time.perf_counter(), cur, late=False if cur.flight.on_device else None)
        elif nxt is not None:
            nxt.start = ready  # its window opens with N's first tokens
        self._count_ahead(cur, ready)
        return [run.req.rid for run in cur.done], nxt

    def _count_ahead(self, cur: _Flying, ready: float) -> None:
        """Step N's figures, running ahead: its window (from the previous step's first
        tokens, or its own ``begin_step`` if nothing ran before it, to its own) less the
        checks' pauses, and the cache's host time the GPU waited for: all of its
        preparation if nothing ran while it was prepared; else, if the pass before it
        had ended by the time it was queued, the device's gap between the two passes
        less that pass's digests (CUDA events; on CPU the host is the device: all of its
        preparation)."""
        wall = ready - cur.start - self._take_checks()
        step = cur.step
        own = step.t1 - step.t0
        if cur.prev is None:
            critical = own
        elif not cur.late:
            critical = 0.0
        else:
            gap = cur.prev.gap_before(cur.flight)
            digests = cur.prev.digests[0].seconds() if cur.prev.digests else 0.0
            critical = own if gap is None else max(0.0, gap - digests)
        self.times.count(max(wall, 0.0), critical)
        self.latency.busy_s += max(wall, 0.0)

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

    def _check(self, flight: InFlight) -> None:
        """Serially: digest the reused blocks (they still hold what attention read:
        nothing writes them while their sequence holds them; a check before the pass
        would make every layer wait for every onboarded block) and the blocks the step
        wrote, compare them at once, and a sample of logits."""
        plan, reused = flight.plan, flight.reused
        logits, written, segs = flight.result
        self.readback.add(queue_step(self.cache, self.ledger, self.model.L, plan, flight.table, reused,
                                     written, segs))
        self.readback.drain()
        self.verify.logits(plan, reused, logits)

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
    def run(self) -> R:
        """Run every request to completion; returns the reporter's results (on every rank)."""
        if self.rank0:
            print(self.reporter.header(self), flush=True)
        bar = tqdm(total=len(self.trace.requests), disable=not (self.rank0 and self.opts.progress),
                   unit="req", desc=self.reporter.label, dynamic_ncols=True, file=sys.stderr,
                   mininterval=0.2 if sys.stderr.isatty() else 5.0)
        self.time.start()
        flying: _Flying | None = None
        try:
            while flying is not None or not self.sched.done():
                try:
                    if not self.parts.run_ahead:
                        done = self._step()
                    else:
                        done, flying = self._step_ahead(flying)
                except ConsistencyError as e:  # every rank learns it at the same collective
                    self.checks.consistency_error = f"step {self.sched.step}: {e}"
                    break
                if self.stop is not None:  # every rank got the same value at the same step
                    raise self.stop
                if self.rank0:
                    self._progress(bar, done)
        finally:
            bar.close()
        self.readback.drain()  # the last steps' digests
        self.cache.synchronize()
        self.checks.consistency_checks = self.cache.stats()["consistency_checks"]
        return self.reporter.results(self)

    def _progress(self, bar: tqdm, done: list[int]) -> None:
        """Rank 0 after every step: the reporter, the progress bar, the metrics."""
        stats = self.cache.stats()
        self.reporter.progress(stats, self.sched.finished)
        bar.update(len(done))
        now = time.perf_counter()
        if now - self._last_update > 0.5:
            self._last_update = now
            prompt = max(stats["prompt_tokens"], 1)
            bar.set_postfix_str(f"reuse {100 * sum(stats['hit_tokens'].values()) / prompt:.0f}%, "
                                f"step {self.sched.step}", refresh=False)
            server = self.parts.server
            if server is not None:
                server.update(snapshot_from(stats, self.sched.finished, self.ledger.mismatched_blocks))

    def close(self) -> None:
        """Free everything (collective: the cache's and the model's communicators)."""
        close_parts(self.parts, self.reporter)


def _appends(plan: StepPlan) -> list[tuple[int, int]]:
    """The decode tokens the step appends: each decode's previous reply token (the
    trace's, so no placeholder token is ever needed)."""
    return [(run.req.rid, int(run.req.output[run.generated - 1])) for run in plan.decodes]
