"""What the run verifies every step: the reused blocks' bytes (against the ledger of
what the model wrote) and a sample of logits (against a from-scratch recompute)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.model import Decoder
from ..engine.scheduler import StepPlan
from .integrity import BlockLedger

_CHUNK_BYTES = 1 << 30  # reused blocks gathered at once for their digests


def logits_tolerance(kv_dtype: torch.dtype, compute_dtype: torch.dtype = torch.float32) -> float:
    """Relative tolerance of the reuse-vs-recompute logits check. Both paths see K/V
    rounded to the cache dtype, but matmuls of different batch shapes may differ in
    the last bit, which can flip a rounding of a narrow K/V dtype; in 16-bit compute
    every layer rounds its outputs (2**-8 relative for bfloat16) in a batch-shape
    dependent order, which 32 layers accumulate."""
    bits = torch.finfo(kv_dtype).bits
    tol = 1e-4 if bits >= 32 else 2e-2 if bits >= 16 else 1e-1
    return max(tol, 5e-2) if torch.finfo(compute_dtype).bits < 32 else tol


@dataclass(slots=True)
class QueuedDigests:
    """Digests of a step's reused blocks, queued on the device."""

    picks: list[tuple[int, int]]  # (prefill index, blocks reused)
    parts: list[torch.Tensor]  # int64 digests, in the order of the picks' blocks


@dataclass(slots=True)
class CheckCounts:
    logits_checked: int = 0
    logits_failed: int = 0
    logits_max_abs_diff: float = 0.0
    consistency_checks: int = 0
    consistency_error: str | None = None
    prefills_with_reuse: int = 0  # prefills that reused something (the logits sample's clock)


class Verifier:
    """One rank's checks; ``ledger`` holds the reference digests."""

    def __init__(self, cache, model: Decoder, ledger: BlockLedger, verify_logits_every: int):
        self.cache, self.model, self.ledger = cache, model, ledger
        self.every = verify_logits_every
        self.tolerance = logits_tolerance(model.kv_dtype, model.cdt)
        self.counts = CheckCounts()

    def reused_blocks(self, plan: StepPlan, table: torch.Tensor, reused: list[int]) -> None:
        """Digest every reused block as the cache hands it back (one gather per layer
        per GiB of blocks) and compare with the reference of what was written."""
        self.check_queued(plan, self.queue_reused(plan, table, reused))

    def queue_reused(self, plan: StepPlan, table: torch.Tensor, reused: list[int]) -> QueuedDigests | None:
        """The digests of the reused blocks, queued on the device now (the pool as the
        forward pass just read it); ``check_queued`` compares them later."""
        tpb = self.cache.layout.tokens_per_block
        picks = [(i, n // tpb) for i, n in enumerate(reused) if n]
        if not picks:
            return None
        rows = torch.cat([table[i, :nb] for i, nb in picks]).long()
        pools = [self.cache.kv_pool(layer) for layer in range(self.model.L)]
        per = max(1, _CHUNK_BYTES // self.cache.layout.bytes_per_block)  # bounded scratch memory
        parts = [self.ledger.digest_queued(torch.stack([p[rows[lo: lo + per]] for p in pools], dim=1))
                 for lo in range(0, len(rows), per)]
        return QueuedDigests(picks, parts)

    def check_queued(self, plan: StepPlan, queued: QueuedDigests | None) -> None:
        """Compare digests ``queue_reused`` queued with the references (waits for them)."""
        if queued is None:
            return
        digests = [d for part in queued.parts for d in part.tolist()]
        at = 0
        for i, nb in queued.picks:
            self.ledger.check_reused(plan.prefills[i].req.rid, digests[at: at + nb])
            at += nb

    def logits(self, plan: StepPlan, reused: list[int], logits: torch.Tensor) -> None:
        """For every ``verify_logits_every``-th request that reused a prefix, the first
        generated token's logits must equal a from-scratch recompute's (collective: the
        ranks agreed on ``reused`` this step, so all pick the same requests)."""
        if not self.every:
            return
        c = self.counts
        for i, n in enumerate(reused):
            if not n:
                continue
            c.prefills_with_reuse += 1
            if (c.prefills_with_reuse - 1) % self.every:
                continue
            ref = self.model.forward_dense(plan.prefills[i].req.prompt)
            diff = float((logits[i] - ref).abs().max())
            scale = max(1.0, float(ref.abs().max()))
            c.logits_checked += 1
            c.logits_failed += diff > self.tolerance * scale
            c.logits_max_abs_diff = max(c.logits_max_abs_diff, diff)
