"""How long vLLM's forward takes per computed token, measured by the worker-side
connector from the calls vLLM makes inside it: from the first layer's
``wait_for_layer_load`` to the last layer's ``save_kv_layer`` (attention of every layer
and what lies between; the embedding and the sampler are left out, so the figure errs
toward recomputing). On CUDA the two marks are events on the current stream, read once
they completed (a later step), never synchronizing; on CPU the host's clock."""

from __future__ import annotations

__all__ = ["ForwardClock"]

import time

import torch


class ForwardClock:
    """Marks of the current step (``start``/``stop``) and the steps measured but not yet
    read (CUDA). Invariant: ``_pending`` holds (start, stop, tokens) of steps whose stop
    was marked, oldest first."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._start: object | None = None
        self._stop: object | None = None
        self._pending: list[tuple[object, object, int]] = []

    def _mark(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self._start, self._stop = self._mark(), None

    def stop(self) -> None:
        if self._start is not None:
            self._stop = self._mark()

    def end_step(self, tokens: int) -> list[tuple[int, float]]:
        """Close the step (``tokens`` computed by its forward); the (tokens, seconds) of
        the steps whose figure can be read now."""
        if self._start is not None and self._stop is not None and tokens > 0:
            self._pending.append((self._start, self._stop, tokens))
        self._start = self._stop = None
        out = []
        while self._pending:
            start, stop, tokens = self._pending[0]
            if not self.cuda:
                out.append((tokens, stop - start))
            elif stop.query():
                out.append((tokens, start.elapsed_time(stop) / 1000))
            else:
                break
            self._pending.pop(0)
        return out
