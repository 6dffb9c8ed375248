"""A step's block digests, queued on the device behind its forward pass and read back
lazily: the host never waits for them.

Every step the run digests the blocks the cache handed back for reuse (the pool as the
pass just read it: nothing writes them while their sequence holds them, and rule S4
makes a later copy into their slots wait for the compute stream) and the blocks the
pass completed (the K/V it wrote). Both are queued on the compute stream right behind
the pass, then copied into pinned host memory with an event recorded after the copy
(CUDA); on a CPU cache they are computed at once. ``Readback`` keeps the steps in
order and compares a step's digests with the ledger only once its event has
completed (``poll``: ``Event.query``, never a synchronization) — a step or more later —
or at the end of the run (``drain``). Steps resolve in order, so the references of
every earlier step are recorded before a later step's reused blocks are compared:
the check is exact, only later.

The digests' own device time is measured too (CUDA events around them; the host's
time on a CPU cache), so the run can leave it out of its timed figures as it leaves
out every other check."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from ..engine.attention import upload
from ..engine.model import Segment
from ..engine.scheduler import StepPlan
from .integrity import BlockLedger

__all__ = ["Readback", "StepDigests", "queue_step"]

_CHUNK_BYTES = 1 << 30  # reused blocks gathered at once for their digests


@dataclass(slots=True)
class StepDigests:
    """One step's digests on their way to the host."""

    reused: list[tuple[Hashable, list[bytes]]]  # (sequence, prefix keys of its reused blocks)
    written: list[tuple[Hashable, int, int, list[bytes]]]  # (sequence, start, tokens, keys completed)
    digests: torch.Tensor  # int64: the reused blocks' in order, then each written token's share
    done: torch.cuda.Event | None = None  # CUDA: recorded after the copy into ``digests``
    started: torch.cuda.Event | None = None  # CUDA: recorded before the digests
    host_s: float = 0.0  # their time on the host (a CPU cache)

    def ready(self) -> bool:
        return self.done is None or self.done.query()

    def seconds(self) -> float:
        """The digests' time on the device (after ``ready``)."""
        if self.done is not None and self.started is not None:
            return self.started.elapsed_time(self.done) / 1e3
        return self.host_s


def queue_step(cache, ledger: BlockLedger, layers: int, plan: StepPlan, table: torch.Tensor,
               reused: list[int], written: torch.Tensor, segs: list[Segment]) -> StepDigests:
    """Queue the digests of the step's reused blocks (read through ``table`` from the
    pool) and of the blocks its K/V ``written`` completed, and their copy to the host;
    the ledger's per-sequence bookkeeping (tokens, prefix keys, partial tails) moves on
    now. Call in step order, right after the pass was queued."""
    t0 = time.perf_counter()
    cuda = cache.device.type == "cuda"
    started = None
    if cuda:
        started = torch.cuda.Event(enable_timing=True)
        started.record()
    tpb = cache.layout.tokens_per_block
    parts: list[torch.Tensor] = []
    picks = []
    for i, n in enumerate(reused):
        if n:
            rid = plan.prefills[i].req.rid
            picks.append((rid, ledger.keys(rid, n // tpb)))
    if picks:
        rows = torch.cat([table[i, :n // tpb] for i, n in enumerate(reused) if n]).long()
        pools = [cache.kv_pool(layer) for layer in range(layers)]
        per = max(1, _CHUNK_BYTES // cache.layout.bytes_per_block)  # bounded scratch memory
        parts += [ledger.digest_queued(torch.stack([p[rows[lo: lo + per]] for p in pools], dim=1))
                  for lo in range(0, len(rows), per)]
    runs = []  # (sequence, start, tokens, prefix keys of the blocks they complete)
    base = len(plan.prefills)
    for k, (seg, run) in enumerate(zip(segs, plan.batch)):
        n = len(seg.tokens)
        runs.append((run.req.rid, seg.start, n, ledger.queue_written(
            run.req.rid, seg.start, n, appended=seg.tokens if k >= base else None)))
    if runs:  # every token the step wrote, its share of its block's digest: a few kernels
        pos = ledger.positions([(start, n) for _, start, n, _ in runs])
        parts.append(ledger.token_digests(written[:len(pos)], upload(pos, written.device)))
    dev = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=cache.device)
    if not cuda:
        return StepDigests(picks, runs, dev, host_s=time.perf_counter() - t0)
    host = torch.empty(dev.shape, dtype=torch.int64, pin_memory=True)
    host.copy_(dev, non_blocking=True)
    done = torch.cuda.Event(enable_timing=True)
    done.record()
    return StepDigests(picks, runs, host, done, started)


class Readback:
    """Steps whose digests are queued, oldest first; each compared with ``ledger`` once
    its digests are on the host."""

    def __init__(self, ledger: BlockLedger):
        self.ledger = ledger
        self._queue: deque[StepDigests] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, step: StepDigests) -> None:
        self._queue.append(step)

    def poll(self) -> float:
        """Compare every step whose digests arrived, in order, up to the first that has
        not (never waits). Returns the device time of the digests compared."""
        took = 0.0
        while self._queue and self._queue[0].ready():
            took += self._resolve(self._queue.popleft())
        return took

    def drain(self) -> float:
        """Wait for every queued step's digests and compare them (the end of a run)."""
        took = 0.0
        while self._queue:
            step = self._queue.popleft()
            if step.done is not None:
                step.done.synchronize()
            took += self._resolve(step)
        return took

    def _resolve(self, step: StepDigests) -> float:
        values = step.digests.tolist()
        at = 0
        for seq_id, keys in step.reused:
            self.ledger.check_keys(seq_id, keys, values[at: at + len(keys)])
            at += len(keys)
        self.ledger.record_tokens(step.written, values[at:])
        return step.seconds()
