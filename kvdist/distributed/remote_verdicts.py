"""The replica's verdicts on fetched blocks (docs/design.md, "Remote tier", rules R1 and
R4): one MIN-reduce inside the TP group agrees the directory counts to apply, every
in-flight block's outcome bits (an AND, as the MIN of 0/1 values) and any figures a
caller rides along; ``decide`` then acts alike on every rank of the replica — lands a
block every rank has GOOD, gives up one some rank gave up, and frees a given-up block's
landing slot once every rank has it DONE."""

from __future__ import annotations

from collections.abc import Callable, Hashable

import numpy as np

from .remote_figures import RemoteCounters
from .remote_plan import Landings, LocalSlots
from .remote_rules import RemoteRules
from .transport import DONE, GOOD, NOTBAD, REASONS, Batch

__all__ = ["agree", "decide"]


def agree(tp, rules: RemoteRules, counts: np.ndarray | None, batches: list[Batch], what: str,
          extra: list[int] | None = None) -> tuple[np.ndarray | None, np.ndarray, list[int] | None]:
    """(directory counts, outcome bits per block of ``batches``, ``extra``) as the
    replica's ranks agree on them over ``tp`` (the TP group's communicator): MIN of the
    counts and of ``extra`` (a caller's own figures riding along), AND of the bits (as
    MIN of each 0/1 bit). A rule switched off keeps this rank's own values."""
    states = (np.concatenate([b.state for b in batches]) if batches
              else np.zeros(0, dtype=np.uint8)).astype(np.int64)
    ride = [] if extra is None else list(extra)
    if tp.size == 1 or not (rules.agree_outcomes or rules.agree_directory or ride):
        return counts, states.astype(np.uint8), extra
    bits = [(states & bit) != 0 for bit in (GOOD, DONE, NOTBAD)]
    mine = np.concatenate([np.array(ride, dtype=np.int64),
                           counts if counts is not None else np.zeros(0, dtype=np.int64), *bits])
    out = tp.allreduce_min_array(mine, what)
    agreed_extra = None if extra is None else out[:len(ride)].tolist()
    out = out[len(ride):]
    n = 0 if counts is None else len(counts)
    agreed_counts = out[:n] if rules.agree_directory else counts
    if rules.agree_outcomes:
        k = len(states)
        g, d, nb = out[n:n + k], out[n + k:n + 2 * k], out[n + 2 * k:n + 3 * k]
        states = g * GOOD + d * DONE + nb * NOTBAD
    return agreed_counts, states.astype(np.uint8), agreed_extra


def decide(batches: list[Batch], verdicts: np.ndarray, slots: LocalSlots, landings: Landings,
           counters: RemoteCounters, landed_for: Callable[[Hashable, set[int]], None]) -> set[int]:
    """Act on the replica's ``verdicts`` (per block of ``batches``, in order): land the
    blocks every rank has whole, give up those some rank gave up, free their slots once
    no transfer can still write them. ``landed_for(seq_id, hashes)`` hears what landed
    for each prefetch. Returns the hashes landed."""
    landed: set[int] = set()
    at = 0
    c = counters
    for b in batches:
        v = verdicts[at:at + len(b)]
        at += len(b)
        mine: set[int] = set()
        for i in np.flatnonzero(~b.released).tolist():
            h = int(b.hi[i]) << 64 | int(b.lo[i])
            if not b.decided[i]:
                if v[i] & GOOD:
                    b.decided[i] = b.released[i] = True
                    landings.untrack(b, i, h)
                    if slots.land(int(b.dst[i]), h):
                        mine.add(h)
                        c.landed += 1
                    else:
                        c.landed_duplicate += 1
                    continue
                if v[i] & NOTBAD:
                    continue  # pending somewhere: decided at a later boundary
                b.decided[i] = True
                landings.untrack(b, i, h)
                c.misses += 1
                if b.reason[i]:
                    c.reasons[REASONS[b.reason[i]]] += 1
            if v[i] & DONE:
                b.released[i] = True
                slots.release(int(b.dst[i]))
        if b.seq_id is not None and mine:
            landed_for(b.seq_id, mine)
        landed |= mine
    return landed
