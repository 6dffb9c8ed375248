"""Continuous batching over a trace: every step admits arrived requests (prefills)
next to the running ones (one decode token each).

The scheduler is a pure function of the trace and its limits, so every rank (SPMD)
and every bookkeeping replay sees the same steps. Admission reserves each request's
worst-case GPU blocks as if nothing were reused: a step can never run out of GPU
blocks, whatever the cache reuses, and the trace is the same with reuse switched off.

Serving one replica of several, the trace is the replica's share: a chat's previous
turn served elsewhere does not hold its next turn back (the trace's ``think_steps``
keep turns apart), and an optional :class:`AdmissionGate` holds back requests whose
prefetch has not landed — a decision the gate agrees on inside the TP group."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ...errors import ConfigError
from .request import Request, RequestSource


@dataclass(slots=True)
class Running:
    req: Request
    generated: int = 0  # reply tokens produced so far (the prefill produces the first)
    reserved: int = 0  # worst-case GPU blocks


@dataclass(slots=True)
class StepPlan:
    step: int
    clock: int  # the trace's time of the step (arrivals up to it are visible)
    prefills: list[Running] = field(default_factory=list)
    decodes: list[Running] = field(default_factory=list)  # each appends output[generated - 1]

    @property
    def batch(self) -> list[Running]:
        return self.prefills + self.decodes


class AdmissionGate(Protocol):
    def start(self, req: Request) -> None:
        """``req``'s GPU blocks are reserved: start moving its cached blocks here."""
        ...

    def ready(self, started: list[Request]) -> set[int]:
        """Ids of the ``started`` requests that may be admitted this step; identical on
        every rank of the TP group."""
        ...


class Scheduler:
    """FIFO admission under three limits: ``max_batch`` sequences, ``max_prefill_tokens``
    prompt tokens per step (a longer prompt runs alone), and the GPU tier's blocks.

    With a gate, a runnable request's blocks are reserved first (FIFO, under the GPU
    limit alone) and the gate starts moving its cached blocks then — a prefetch may
    land them in GPU blocks, which the reservation covers — and the request is admitted
    once the gate says so, under the other two limits."""

    def __init__(self, trace: RequestSource, *, max_batch: int, max_prefill_tokens: int,
                 gpu_blocks: int, tokens_per_block: int, gate: AdmissionGate | None = None,
                 open_ended: bool = False):
        self.tpb = tokens_per_block
        self.gate = gate
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.gpu_blocks = gpu_blocks
        self._fits(trace.requests)
        self._pending: deque[Request] = deque(trace.requests)  # in arrival order
        self._waiting: list[Request] = []  # arrived, not admitted
        self._finished: set[int] = set()
        self._mine = {r.rid for r in trace.requests}
        self._ahead: dict[int, int] = {}  # gated: request id -> blocks reserved before admission
        self.running: list[Running] = []
        self.reserved = 0
        self.step = 0
        self.clock = 0  # the trace's time: arrivals up to ``clock`` are visible
        self.total = len(trace.requests)
        self._open = open_ended  # more requests may be added (a router sends them as they arrive)

    def _fits(self, reqs: Sequence[Request]) -> None:
        worst = max(reqs, key=lambda r: r.blocks_needed(self.tpb), default=None)
        if worst is not None and worst.blocks_needed(self.tpb) > self.gpu_blocks:
            raise ConfigError("cache.gpu", f"{self.gpu_blocks} blocks",
                              f"request {worst.rid} needs {worst.blocks_needed(self.tpb)} "
                              "blocks; enlarge the GPU tier or shorten workload.turns/user_tokens")

    def add(self, reqs: Sequence[Request]) -> None:
        """Requests routed here during the run (an ``open_ended`` scheduler), in the
        order they arrive; identical on every rank of the TP group."""
        assert self._open, "requests added to a scheduler that was closed or never open"
        self._fits(reqs)
        self._pending.extend(reqs)
        self._mine.update(r.rid for r in reqs)
        self.total += len(reqs)

    def close(self) -> None:
        """No more requests will be added: the scheduler is done once these finish."""
        self._open = False

    def done(self) -> bool:
        return not self._open and len(self._finished) == self.total

    @property
    def finished(self) -> int:
        return len(self._finished)

    def next_step(self, now: float | None = None) -> StepPlan | None:
        """The next step's batch. In step time (``now`` None) idle time is skipped:
        the clock jumps to the next arrival; with a gate the batch may be empty (a step
        that only waits for prefetches). In real time the requests that arrived by
        ``now`` (seconds, ``Request.arrival_s``) are visible, and None means there is
        nothing to do until ``next_arrival()``."""
        assert not self.done(), "every request has finished"
        if now is None:
            if not self.running and not self._waiting:
                self.clock = max(self.clock, self._pending[0].arrival)
            while self._pending and self._pending[0].arrival <= self.clock:
                self._waiting.append(self._pending.popleft())
        else:
            while self._pending and self._pending[0].arrival_s <= now:
                self._waiting.append(self._pending.popleft())
        plan = StepPlan(self.step, self.clock, decodes=list(self.running))
        prefill_tokens = 0
        admitted: list[Request] = []
        eligible = self._eligible()
        allowed = None if self.gate is None else self._gate(eligible)
        for req in eligible:
            if allowed is not None and req.rid not in allowed:
                continue  # its blocks are on their way, or not reserved yet
            need = req.blocks_needed(self.tpb)
            ahead = req.rid in self._ahead
            if (len(self.running) + len(plan.prefills) >= self.max_batch
                    or (not ahead and self.reserved + need > self.gpu_blocks)
                    or (plan.prefills and prefill_tokens + len(req.prompt) > self.max_prefill_tokens)):
                break  # strict FIFO among ready requests: a large one is not starved
            if ahead:
                del self._ahead[req.rid]
            else:
                self.reserved += need
            run = Running(req, reserved=need)
            plan.prefills.append(run)
            admitted.append(req)
            prefill_tokens += len(req.prompt)
        if admitted:
            ids = {r.rid for r in admitted}
            self._waiting = [r for r in self._waiting if r.rid not in ids]
        self.running.extend(plan.prefills)
        if now is not None and not plan.batch and not eligible:
            return None  # real time: nothing to do before the next arrival
        assert plan.batch or eligible, "a step with nothing to do"  # empty: held by the gate
        return plan

    def upcoming(self) -> list[Request]:
        """The arrived requests next in line, as many as one step could admit (under
        ``max_batch`` and ``max_prefill_tokens``, at least one): what a step's
        ``cache.prefetch`` looks ahead to. Depends only on the scheduler's state, so
        every rank of a TP group sees the same list."""
        out, tokens = [], 0
        for req in self._eligible():
            if out and (len(out) >= self.max_batch or tokens + len(req.prompt) > self.max_prefill_tokens):
                break
            out.append(req)
            tokens += len(req.prompt)
        return out

    def _eligible(self) -> list[Request]:
        """The arrived requests, in order, but for a chat's turn whose previous turn still
        runs here (that turn holds it back, and its prompt is not cached yet)."""
        return [r for r in self._waiting if r.after not in self._mine or r.after in self._finished]

    def next_arrival(self) -> float | None:
        """Arrival time (seconds) of the next request not visible yet."""
        return self._pending[0].arrival_s if self._pending else None

    def advance(self, clock: int) -> None:
        """Time kept outside the scheduler (a replica's wall-clock steps): arrivals up to
        ``clock`` become visible at the next step."""
        self.clock = max(self.clock, clock)

    def idle_until(self) -> int | None:
        """With nothing running or waiting, the clock of the next arrival (else None)."""
        return None if self.running or self._waiting else self._pending[0].arrival

    def _gate(self, eligible: list[Request]) -> set[int]:
        """Reserve the blocks of runnable requests in FIFO order and start their
        prefetches; the ids the gate lets in."""
        for req in eligible:
            if req.rid in self._ahead:
                continue
            need = req.blocks_needed(self.tpb)
            if self.reserved + need > self.gpu_blocks:
                break
            self._ahead[req.rid] = need
            self.reserved += need
            self.gate.start(req)
        return self.gate.ready([r for r in eligible if r.rid in self._ahead])

    def complete(self, plan: StepPlan) -> list[Running]:
        """Account the step's generated tokens; returns the requests that finished."""
        done = []
        for run in plan.batch:
            run.generated += 1
            if run.generated == len(run.req.output):
                done.append(run)
        if done:
            gone = {id(r) for r in done}
            self.running = [r for r in self.running if id(r) not in gone]
            for r in done:
                self._finished.add(r.req.rid)
                self.reserved -= r.reserved
        self.step += 1
        self.clock += 1
        return done
