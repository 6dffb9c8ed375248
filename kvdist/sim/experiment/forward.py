"""A step's forward pass in flight: launched on the compute stream (with the digests
of the blocks it reused and wrote queued right behind it, when the host runs ahead:
``readback``), waited for when the host needs its first tokens, and its device time
measured. Nothing here makes the host wait for the device but ``wait``.

Where it runs: on CUDA the kernels are queued and the host goes on (CUDA events
around the pass time it on the device); on a plain CPU cache the pass runs on the
host at once; with simulated streams (``cache.simulate_async``) it is a 'kernel' on
the simulated compute stream behind the step's copies and table upload, run when
something forces it — ``wait``, or a later copy that must follow it (rule S4)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ...cache import KVCache
from ..engine.model import Decoder, Segment
from ..engine.scheduler import StepPlan
from .integrity import BlockLedger
from .readback import StepDigests, queue_step

__all__ = ["InFlight", "launch", "segments", "wait"]


@dataclass(slots=True)
class InFlight:
    """One step's forward pass, launched."""

    plan: StepPlan
    table: torch.Tensor
    reused: list[int]
    out: list[tuple] = field(default_factory=list)  # [(logits, K/V written, segments)] once run
    digests: list[StepDigests] = field(default_factory=list)  # queued behind it (run ahead)
    kernel: object | None = None  # the simulated compute stream's op
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # CUDA: around the pass
    host_s: float = 0.0  # the pass's time where the host runs it (CPU, simulated streams)

    @property
    def result(self) -> tuple:
        assert self.out, "the forward pass has not run (wait for it first)"
        return self.out[0]

    @property
    def on_device(self) -> bool:
        """The pass runs on a CUDA device (timed by events), not on the host."""
        return self.events is not None

    def gap_before(self, nxt: InFlight) -> float | None:
        """The device's time between the end of this pass and the start of ``nxt``
        (CUDA events; after ``wait`` for ``nxt``), else None."""
        if self.events is None or nxt.events is None:
            return None
        return self.events[1].elapsed_time(nxt.events[0]) / 1e3

    def ended(self) -> bool:
        """Whether the pass has ended on the device (never waits). Where the host runs
        it (CPU, simulated streams), the device is the host: true."""
        return self.events is None or self.events[1].query()

    def device_seconds(self) -> float:
        """The pass's time on the device (CUDA events), else on the host; after ``wait``."""
        if self.events is not None:
            return self.events[0].elapsed_time(self.events[1]) / 1e3
        return self.host_s


def launch(cache: KVCache, model: Decoder, plan: StepPlan, table: torch.Tensor, reused: list[int],
           ledger: BlockLedger, *, digest: bool) -> InFlight:
    """Queue the step's forward pass (``digest``: and the digests of its reused and
    written blocks right behind it, the reused ones before any later step's copy can
    overwrite them: S4 makes those wait for the compute stream as it is at the next
    ``begin_step``)."""
    flight = InFlight(plan, table, reused)
    segs = segments(plan, reused)  # fixed now: the plan's requests move on before a queued pass runs

    def forward() -> None:
        t0 = time.perf_counter()
        logits, written = model.forward_cached(cache, table, segs)
        flight.out.append((logits, written, segs))
        flight.host_s = time.perf_counter() - t0

    def digests() -> None:
        if digest:
            _, written, _ = flight.result
            flight.digests.append(queue_step(cache, ledger, model.L, plan, table, reused, written, segs))

    compute = cache.simulated_compute
    if compute is not None:
        flight.kernel = compute.kernel(lambda: (forward(), digests()))
    elif cache.device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        forward()
        end.record()  # the first tokens: what the host waits for
        digests()
        flight.events = (start, end)
    else:
        forward()
        digests()
    return flight


def wait(cache: KVCache, flight: InFlight, sync: Callable[[], None] | None = None) -> None:
    """The host waits for the pass (``sync``: the clock's own wait, the serial loop's;
    running ahead, only for the event after the pass: not for what is queued behind it)."""
    compute = cache.simulated_compute
    if flight.kernel is not None:
        compute.force(flight.kernel)
    elif sync is not None:
        sync()
    elif flight.events is not None:
        flight.events[1].synchronize()


def segments(plan: StepPlan, reused: list[int]) -> list[Segment]:
    """The step's new tokens, one segment per sequence: each prefill's prompt past what
    it reused, each decode's previous reply token."""
    segs = [Segment(i, n, run.req.prompt[n:]) for i, (run, n) in enumerate(zip(plan.prefills, reused))]
    for j, run in enumerate(plan.decodes):
        pos, g = len(run.req.prompt) + run.generated - 1, run.generated
        segs.append(Segment(len(plan.prefills) + j, pos, run.req.output[g - 1: g]))
    return segs
