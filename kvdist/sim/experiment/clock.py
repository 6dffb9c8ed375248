"""Time in a run and what each request saw of it.

``StepTime`` is the trace's own clock (arrivals counted in scheduler steps; the
bookkeeping replays need nothing else). ``RealTime`` is the wall clock of a run in
real time: requests arrive at ``Request.arrival_s`` seconds (open loop), a step
starts as soon as there is work, and the device is synchronized after every forward
pass (the first token is on the host, as a server would return it). The clock stops
while the run verifies what the cache handed back (digests, logits recomputes,
consistency checks), so checking costs no configuration any latency; digests read
back lazily are left out once their device time is known (``add_pause``). With several
ranks, rank 0's clock is the run's: every step the ranks take its reading (one
broadcast), so they all admit the same requests.

``Latencies`` records, per request, the effective arrival (a chat's next turn cannot
be sent before the previous reply is complete: ``max(arrival_s, previous finish)``),
its admission, the first token and the last, and summarizes them: TTFT percentiles,
queueing (arrival to admission: it grows without bound once the offered load exceeds
what the configuration serves), time per output token, requests and prompt tokens per
second."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from ..engine.parallel import TensorParallel
from ..engine.request import Request
from ..engine.scheduler import Scheduler


class StepTime:
    """No wall clock: nothing to synchronize, nothing paused; the scheduler counts its
    own steps (one step of the trace per step)."""

    realtime = False

    def __init__(self, device: torch.device):
        self.device = device

    def start(self) -> None:
        """The run starts (every rank, before its first step)."""

    def before_step(self, sched: Scheduler) -> float | None:
        """The trace's time to schedule the next step at (``Scheduler.next_step``);
        ``None``: the scheduler's own step count."""
        return None

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def paused(self):
        yield

    def add_pause(self, seconds: float) -> None:
        """Leave out ``seconds`` the device spent on checks, measured after the fact."""


class RealTime(StepTime):
    """Seconds since ``start()``, less the time spent paused."""

    realtime = True

    def __init__(self, device: torch.device, tp: TensorParallel):
        super().__init__(device)
        self.tp = tp
        self._origin = time.perf_counter()
        self.paused_s = 0.0

    def start(self) -> None:
        self.sync()
        self._origin = time.perf_counter()
        self.paused_s = 0.0

    def local(self) -> float:
        return time.perf_counter() - self._origin - self.paused_s

    def before_step(self, sched: Scheduler) -> float | None:
        return self.now()

    def now(self) -> float:
        """The run's time, agreed: rank 0's reading on every rank."""
        t = self.local()
        return t if self.tp.size == 1 else float(self.tp.bcast(t))

    def sleep_until(self, t: float) -> None:
        wait = t - self.local()
        if wait > 0:
            time.sleep(wait)

    @contextmanager
    def paused(self):
        self.sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.paused_s += time.perf_counter() - t0

    def add_pause(self, seconds: float) -> None:
        self.paused_s += seconds


class WallSteps(StepTime):
    """The trace's time by the wall clock, one step per ``step_ms``, the same on every
    replica of a job (``start`` is a barrier of the job's ``world``); agreed inside the
    TP group ``tp`` (its ranks read the clock at slightly different moments). With
    nothing running or waiting, a step sleeps until the next arrival."""

    def __init__(self, device: torch.device, tp: TensorParallel, world: TensorParallel, step_ms: float):
        super().__init__(device)
        self.tp, self.world, self.step_s = tp, world, step_ms / 1e3
        self.t0 = 0.0  # time.monotonic() at the start, the same moment everywhere

    def start(self) -> None:
        self.world.barrier()
        self.t0 = time.monotonic()

    def before_step(self, sched: Scheduler) -> float | None:
        now = int((time.monotonic() - self.t0) / self.step_s)
        now = -self.tp.allreduce_min([-now])[0]  # the latest clock of the group
        nxt = sched.idle_until()
        if nxt is not None and nxt > now:  # the same on every rank of the group
            time.sleep(max(0.0, self.t0 + nxt * self.step_s - time.monotonic()))
            now = nxt
        sched.advance(now)
        return None


def _pct(a: np.ndarray, q: float) -> float:
    return float(np.percentile(a, q)) if len(a) else float("nan")


@dataclass(slots=True)
class Latencies:
    arrival: dict[int, float] = field(default_factory=dict)  # effective arrival
    admit: dict[int, float] = field(default_factory=dict)  # start of the step that admitted it
    first: dict[int, float] = field(default_factory=dict)
    finish: dict[int, float] = field(default_factory=dict)
    outputs: dict[int, int] = field(default_factory=dict)
    prompt: dict[int, int] = field(default_factory=dict)
    busy_s: float = 0.0  # time inside steps (not idle, not paused)

    def admitted(self, req: Request, now: float = 0.0) -> None:
        after = self.finish.get(req.after, 0.0) if req.after >= 0 else 0.0
        self.arrival[req.rid] = max(req.arrival_s, after)
        self.admit[req.rid] = now
        self.outputs[req.rid] = len(req.output)
        self.prompt[req.rid] = len(req.prompt)

    def ttft(self) -> np.ndarray:
        return np.array([self.first[r] - self.arrival[r] for r in self.first])

    def summary(self) -> dict:
        ttft = self.ttft()
        queue = np.array([self.admit[r] - self.arrival[r] for r in self.first])
        tpot = np.array([(self.finish[r] - self.first[r]) / (self.outputs[r] - 1)
                         for r in self.finish if self.outputs[r] > 1])
        start = min(self.arrival.values(), default=0.0)
        span = max(self.finish.values(), default=0.0) - start
        prompt = sum(self.prompt[r] for r in self.finish)
        return {
            "requests": len(self.finish),
            "ttft_s": sorted(ttft.tolist()),
            "ttft_ms": {"p50": 1e3 * _pct(ttft, 50), "p90": 1e3 * _pct(ttft, 90), "p99": 1e3 * _pct(ttft, 99),
                        "mean": 1e3 * float(ttft.mean()) if len(ttft) else float("nan")},
            # Arrival to the start of the admitting step: grows without bound when saturated.
            "queue_ms": {"p50": 1e3 * _pct(queue, 50), "p99": 1e3 * _pct(queue, 99)},
            "tpot_ms": {"p50": 1e3 * _pct(tpot, 50), "mean": 1e3 * float(tpot.mean()) if len(tpot) else
                        float("nan")},
            "span_s": span,
            "busy_s": self.busy_s,
            "busy_fraction": self.busy_s / span if span > 0 else float("nan"),
            "requests_per_s": len(self.finish) / span if span > 0 else float("nan"),
            "prompt_tokens_per_s": prompt / span if span > 0 else float("nan"),
            "prompt_tokens_per_busy_s": prompt / self.busy_s if self.busy_s > 0 else float("nan"),
        }
