"""What the run verifies every step: the reused blocks' bytes (against the ledger of
what the model wrote: ``readback``) and a sample of logits (against a from-scratch
recompute)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.model import Decoder
from ..engine.scheduler import StepPlan
from .integrity import BlockLedger


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

    def logits_due(self, reused: list[int]) -> bool:
        """Whether ``logits`` recomputes a request of a step that reused ``reused``."""
        if not self.every:
            return False
        n = sum(1 for r in reused if r)
        at = self.counts.prefills_with_reuse
        return any((at + k) % self.every == 0 for k in range(n))

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
