"""The start-up protocol (docs/design.md, "Start-up"): every rank builds a local candidate, then all
ranks agree to commit it, to rebuild it without the host tier, or to abort.

```
exchange: config digest + planned capacities (one allgather); digests differ -> ConsensusAbort
          capacity = element-wise MIN of the plans
phase 1:  build the candidate with every tier
            HostTierUnavailable -> USE_NO_HOST, any other error -> ABORT, else KEEP_HOST
          agreed = MAX-allreduce(status)
            ABORT       -> tear down, exchange reasons, raise
            USE_NO_HOST -> tear down, exchange reasons, warn, rebuild without the host tier
phase 2:  agreed = MAX-allreduce(ABORT if the rebuild failed else USE_NO_HOST)
            ABORT       -> tear down, exchange reasons, raise
commit
```

Every rank reaches every collective whatever fails locally, and the same code runs on
one rank without MPI (its collectives are the identity). Until commit a candidate is
this rank's cleanup duty: if a collective raises or times out, it is torn down before
the error propagates. On ABORT the rank that failed raises its own error; the others
raise ConsensusAbort naming every failed rank and its reason."""

from __future__ import annotations

import enum
import logging
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .. import faults
from ..config import CacheConfig
from ..errors import ConsensusAbort, HostTierUnavailable
from . import capacity as caps

log = logging.getLogger("kvdist.consensus")
_REASON_CHARS = 400


class InitStatus(enum.IntEnum):
    """What the ranks agreed at start-up; larger is worse, so agreement is a MAX."""

    KEEP_HOST = 0
    USE_NO_HOST = 1
    ABORT = 2


class HostTierWarning(UserWarning):
    """Some rank could not have its host tier; every rank runs without one."""


class Candidate(Protocol):
    def teardown(self) -> None: ...


class Builder(Protocol):
    """What the protocol needs from the layer that allocates tiers."""

    def plan(self) -> caps.Capacity:
        """Blocks per tier (gpu, host, disk) this rank could allocate. No allocation."""

    def build(self, capacity: caps.Capacity, *, with_host: bool, fallback: bool) -> Candidate:
        """Allocate a candidate of ``capacity`` (host tier left out unless ``with_host``).
        Must free whatever it allocated before raising."""


@dataclass(slots=True)
class InitTiming:
    """Seconds this rank spent in create(): planning, tier allocation (every build),
    teardown of discarded candidates, and consensus (communicator set-up and every
    collective, including waiting for slower ranks)."""

    plan: float = 0.0
    build: float = 0.0
    teardown: float = 0.0
    consensus: float = 0.0
    builds: int = 0
    teardowns: int = 0

    @contextmanager
    def clock(self, part: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, part, getattr(self, part) + time.perf_counter() - t0)

    def as_dict(self) -> dict[str, float]:
        return {"plan": self.plan, "build": self.build, "teardown": self.teardown,
                "consensus": self.consensus,
                "total": self.plan + self.build + self.teardown + self.consensus}


@dataclass(slots=True)
class Committed:
    """The outcome on every rank that did not raise."""

    candidate: Candidate
    status: InitStatus
    capacity: caps.Capacity
    failures: dict[int, str] = field(default_factory=dict)  # ranks that could not pin, why
    timing: InitTiming = field(default_factory=InitTiming)


def _reason(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}"
    return text if len(text) <= _REASON_CHARS else text[: _REASON_CHARS - 3] + "..."


def outliers(values: list) -> tuple[int, list[int]]:
    """(reference rank, ranks whose value differs from the reference). The reference
    value is the most common one; ties go to the value of the lowest rank."""
    counts = Counter(values)
    best = max(counts.values())
    ref = next(r for r, v in enumerate(values) if counts[v] == best)
    return ref, [r for r, v in enumerate(values) if v != values[ref]]


def config_differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Dotted keys where two normalized configs differ, with both values."""
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            out.extend(config_differences(va, vb, f"{prefix}{key}."))
        elif va != vb:
            out.append(f"{prefix}{key}={va!r} (reference {vb!r})")
    return out


class _Protocol:
    """One run of the protocol on one rank. ``candidate`` is this rank's cleanup duty."""

    def __init__(self, comm, cfg: CacheConfig, builder: Builder, timing: InitTiming):
        self.comm = comm
        self.cfg = cfg
        self.builder = builder
        self.timing = timing
        self.candidate: Candidate | None = None

    # -- helpers ------------------------------------------------------------------------------
    def collective(self, fn, *args):
        """Run a collective; on any error (timeout included) drop the candidate first."""
        try:
            with self.timing.clock("consensus"):
                return fn(*args)
        except BaseException as e:
            self.teardown(propagating=e)
            raise

    def teardown(self, propagating: BaseException | None = None) -> Exception | None:
        """Drop the candidate. A teardown error is returned, not raised: this rank must
        still reach the next collective (or let ``propagating`` leave, noted)."""
        if self.candidate is None:
            return None
        cand, self.candidate = self.candidate, None
        self.timing.teardowns += 1
        try:
            with self.timing.clock("teardown"):
                cand.teardown()
        except Exception as e:
            if propagating is not None and hasattr(propagating, "add_note"):
                propagating.add_note(f"tearing down the candidate also failed: {_reason(e)}")
            return e
        return None

    def build(self, capacity: caps.Capacity, *, with_host: bool,
              fallback: bool) -> tuple[InitStatus, BaseException | None]:
        assert self.candidate is None, "a candidate is already held"
        self.timing.builds += 1
        try:
            with self.timing.clock("build"):
                self.candidate = self.builder.build(capacity, with_host=with_host, fallback=fallback)
        except HostTierUnavailable as e:
            return (InitStatus.ABORT if fallback else InitStatus.USE_NO_HOST), e
        except Exception as e:
            return InitStatus.ABORT, e
        return (InitStatus.USE_NO_HOST if fallback else InitStatus.KEEP_HOST), None

    def exchange_reasons(self, status: InitStatus, error: BaseException | None,
                         what: str) -> dict[int, tuple[int, str]]:
        """{rank: (status, reason)} of every rank whose status is not the healthy one."""
        mine = None if error is None else (int(status), _reason(error))
        gathered = self.collective(self.comm.allgather, mine, what)
        return {r: g for r, g in enumerate(gathered) if g is not None}

    def abort(self, own_error: BaseException | None, failures: dict[int, str], what: str):
        """Raise on ABORT: this rank's own error if it is one that aborted, else
        ConsensusAbort naming every failed rank."""
        if own_error is not None:
            summary = "; ".join(f"rank {r}: {why}" for r, why in sorted(failures.items()))
            if hasattr(own_error, "add_note"):
                own_error.add_note(f"kvdist start-up aborted on all {self.comm.size} rank(s) "
                                   f"({what}): {summary}")
            raise own_error
        raise ConsensusAbort(f"kvdist start-up aborted on all {self.comm.size} rank(s) ({what})",
                             failures)

    # -- the protocol -------------------------------------------------------------------------
    def exchange_plans(self) -> tuple[caps.Capacity | None, BaseException | None]:
        """One allgather of (config digest, planned capacity); raise on a config mismatch."""
        try:
            with self.timing.clock("plan"):
                planned, plan_error = self.builder.plan(), None
        except Exception as e:
            planned, plan_error = None, e
        digest = np.frombuffer(bytes.fromhex(self.cfg.digest()), dtype=np.int64).tolist()
        table = self.collective(self.comm.allgather_ints, digest + caps.encode(planned),
                                "config digest and planned capacities")
        n = len(digest)
        ref, differing = outliers([tuple(row[:n]) for row in table.tolist()])
        if differing:
            self.config_mismatch(ref, differing)
        capacity = caps.min_capacity(table[:, n:])
        if capacity is not None and self.comm.rank == 0:
            plans = [None if row[0] == caps.UNPLANNED else tuple(row) for row in table[:, n:].tolist()]
            reduced = caps.describe(plans, capacity)
            if reduced:
                log.info("tier capacities MIN-reduced across ranks to %s blocks: %s", capacity, reduced)
        return capacity, plan_error

    def config_mismatch(self, ref: int, differing: list[int]):
        configs = self.collective(self.comm.allgather, self.cfg.normalized(), "normalized configs")
        failures = {}
        for r in differing:
            diff = config_differences(configs[r], configs[ref])
            failures[r] = f"config differs from rank {ref}'s: " + ", ".join(diff[:8]) + (
                f" and {len(diff) - 8} more" if len(diff) > 8 else "")
        raise ConsensusAbort(
            f"kvdist start-up aborted: the normalized configs differ on rank(s) "
            f"{', '.join(map(str, differing))} (compared to rank {ref}, the majority)", failures)

    def run(self) -> Committed:
        capacity, error = self.exchange_plans()
        rank = self.comm.rank
        status = InitStatus.ABORT
        if error is None:
            assert capacity is not None, "every rank planned yet no capacity was agreed"
            status, error = self.build(capacity, with_host=True, fallback=False)
        try:
            faults.stall("stall", rank, self.comm.timeout_s)
        except BaseException as e:
            self.teardown(propagating=e)
            raise
        agreed = InitStatus(self.collective(self.comm.allreduce_max, int(status), "phase 1: status"))
        if agreed == InitStatus.KEEP_HOST:
            return Committed(self.candidate, agreed, capacity, {}, self.timing)

        # Every rank drops its candidate: ABORT frees it, USE_NO_HOST rebuilds without the host tier.
        teardown_error = self.teardown()
        failed = self.exchange_reasons(status, error, "phase 1: reasons")
        failures = {r: why for r, (_, why) in failed.items()}
        if agreed == InitStatus.ABORT:
            self.abort(error if status == InitStatus.ABORT else None, failures, "phase 1")
        pinned_less = ", ".join(f"rank {r}: {why}" for r, why in sorted(failures.items()))
        warnings.warn(
            f"kvdist: running without the host tier on all {self.comm.size} rank(s) "
            f"(USE_NO_HOST): the host tier could not be had on {pinned_less}",
            HostTierWarning, stacklevel=5)  # the caller of kvdist.create (-> build -> establish)

        assert capacity is not None
        if teardown_error is None:
            status2, error2 = self.build(capacity, with_host=False, fallback=True)
        else:  # memory of the old candidate may still be held: do not stack a second one
            status2, error2 = InitStatus.ABORT, teardown_error
        agreed2 = InitStatus(self.collective(self.comm.allreduce_max, int(status2), "phase 2: status"))
        if agreed2 == InitStatus.ABORT:
            self.teardown()
            failed2 = self.exchange_reasons(status2, error2, "phase 2: reasons")
            for r, (_, why) in failed2.items():
                prior = failures.get(r)
                failures[r] = f"rebuild without the host tier: {why}" + (
                    f" (after {prior})" if prior else "")
            self.abort(error2 if status2 == InitStatus.ABORT else None, failures,
                       "phase 2, rebuilding without the host tier")
        host_less = (capacity[0], 0, capacity[2])
        return Committed(self.candidate, InitStatus.USE_NO_HOST, host_less, failures, self.timing)


def establish(comm, cfg: CacheConfig, builder: Builder,
              timing: InitTiming | None = None) -> Committed:
    """Run the protocol over ``comm`` (a SingleComm or MpiComm); collective. Returns the
    committed candidate, or raises on every rank (docs/design.md, "Start-up")."""
    return _Protocol(comm, cfg, builder, timing or InitTiming()).run()
