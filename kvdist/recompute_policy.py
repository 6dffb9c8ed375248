"""Onboard or recompute: a cached block in a cold tier is worth onboarding only when
copying it costs less time than computing its tokens again (docs/design.md, "Onboard or
recompute").

Figures, kept as running means:

* each cold tier's onboard bandwidth (bytes per second of the copies that brought
  blocks from it to the GPU, as the executor timed them);
* the engine's prefill cost (seconds per computed token of its prefill steps, which it
  reports through ``KVCache.observe_prefill``).

The decision for one prompt's cached prefix (blocks in order, each in some tier) is
the cut ``k`` that minimizes ``onboard(blocks before k) + recompute(blocks after k)``:
GPU hits cost nothing, a host or disk hit costs ``block bytes / its tier's
bandwidth``, a block not reused costs ``tokens per block x seconds per token``. A
prefix must stay contiguous, so a slow block in the middle also gives up the
blocks after it when that is cheaper than onboarding it. With no figure yet for a tier
(or no prefill figure) its blocks are onboarded: that is how the figure is measured.

Ranks of one TP group must cut identically, but their measured figures differ. So
decisions use only *agreed* figures: each rank's figures are MIN-reduced (the
slowest rank bounds both an onboard and a recompute) at every step boundary
(``KVCache.end_step``) and take effect from the next step on.

The same figures decide where evicted blocks go: a tier whose blocks would never be
onboarded back (``worth_storing``) receives none; a host block evicted then is dropped
rather than demoted, so a slow disk costs no write traffic either."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .blocks import DISK, GPU, HOST, TIER_NAMES

UNKNOWN = 1 << 62  # "no figure yet": larger than any rate, so it never wins a MIN
_WEIGHT = 0.2  # of a new observation in a running mean


def _mean(old: float, new: float) -> float:
    return new if old <= 0 else (1 - _WEIGHT) * old + _WEIGHT * new


@dataclass(slots=True)
class PolicyCounts:
    onboarded: list[int] = field(default_factory=lambda: [0, 0, 0])  # blocks, by tier
    recomputed: list[int] = field(default_factory=lambda: [0, 0, 0])  # cold hits recomputed instead


class RecomputePolicy:
    """Per-rank figures, the agreed figures, and the cut."""

    FIGURES = ("host_bytes_per_s", "disk_bytes_per_s", "prefill_tokens_per_s")

    def __init__(self, bytes_per_block: int, tokens_per_block: int, enabled: bool = True):
        self.bpb, self.tpb, self.enabled = bytes_per_block, tokens_per_block, enabled
        self._bw = [0.0, 0.0, 0.0]  # measured bytes/s by tier (GPU unused)
        self._s_per_token = 0.0
        self.agreed = [UNKNOWN, UNKNOWN, UNKNOWN]  # FIGURES, as ints
        self.counts = PolicyCounts()

    # -- figures -----------------------------------------------------------------------------
    def observe_copy(self, tier: int, nbytes: int, seconds: float) -> None:
        """A copy of ``nbytes`` from ``tier`` to the GPU took ``seconds``."""
        if nbytes > 0 and seconds > 0:
            self._bw[tier] = _mean(self._bw[tier], nbytes / seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self._s_per_token = _mean(self._s_per_token, seconds / tokens)

    def local_figures(self) -> list[int]:
        """This rank's figures (FIGURES order), to be MIN-reduced over the TP group."""
        rate = int(1 / self._s_per_token) if self._s_per_token > 0 else UNKNOWN
        return [int(self._bw[HOST]) or UNKNOWN, int(self._bw[DISK]) or UNKNOWN, max(rate, 1)]

    def agree(self, figures: list[int]) -> None:
        """Adopt the group's figures (every rank passes the same list)."""
        assert len(figures) == 3, f"expected {self.FIGURES}, got {figures}"
        self.agreed = [int(v) for v in figures]

    # -- the decision ----------------------------------------------------------------------------
    def cut(self, tiers) -> int:
        """How many leading blocks of a cached prefix to reuse; ``tiers[i]`` is block
        i's tier (a list or an int array). Changes nothing (``record`` counts the
        decision once it stands)."""
        n = len(tiers)
        host_bw, disk_bw, rate = self.agreed
        if not self.enabled or rate >= UNKNOWN or n == 0:
            return n
        recompute = self.tpb / rate
        onboard = np.array([0.0, self.bpb / host_bw if host_bw < UNKNOWN else 0.0,
                            self.bpb / disk_bw if disk_bw < UNKNOWN else 0.0])
        gain = onboard[np.asarray(tiers)] - recompute
        if gain.max() < 0:
            return n  # every block is cheaper to onboard than to compute: the usual case
        # The running total block by block (cumsum adds in order, as a loop would); the
        # first strict minimum below zero: onboard only when faster.
        total = np.cumsum(gain)
        best = int(np.argmin(total))
        return best + 1 if total[best] < 0.0 else 0

    def worth_storing(self, tier: int) -> bool:
        """Whether a block moved into ``tier`` could ever be onboarded back (it is not
        dearer to copy than to recompute by the agreed figures). When it could not,
        moving blocks there is write traffic for nothing: the manager drops them
        instead (and keeps no room free there ahead of time). Agreed figures only, so
        the ranks of a TP group decide alike."""
        if not self.enabled or tier == GPU:
            return True
        bw, rate = self.agreed[tier - 1], self.agreed[2]  # FIGURES: host, disk, prefill
        if bw >= UNKNOWN or rate >= UNKNOWN:
            return True
        return self.bpb / bw < self.tpb / rate

    def record(self, tiers, k: int) -> None:
        """Count the cold blocks of a prefix onboarded (before ``k``) and given up
        (``tiers`` a list or an int array)."""
        c, t = self.counts, np.asarray(tiers, dtype=np.int64)
        for counts, part in ((c.onboarded, t[:k]), (c.recomputed, t[k:])):
            per_tier = np.bincount(part, minlength=3).tolist()
            for tier in (HOST, DISK):
                counts[tier] += per_tier[tier]

    def stats(self, has_tier) -> dict:
        host_bw, disk_bw, rate = self.agreed
        known = lambda v: None if v >= UNKNOWN else v  # noqa: E731
        cold = [t for t in (HOST, DISK) if has_tier(t)]
        return {"enabled": self.enabled,
                "onboarded_blocks": {TIER_NAMES[t]: self.counts.onboarded[t] for t in cold},
                "recomputed_blocks": {TIER_NAMES[t]: self.counts.recomputed[t] for t in cold},
                "host_bytes_per_s": known(host_bw), "disk_bytes_per_s": known(disk_bw),
                "prefill_tokens_per_s": known(rate)}
