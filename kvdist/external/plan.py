"""The values that pass between the two sides of ``cache.gpu: external``: what the
planner (the engine's scheduler) decided, shipped to every worker rank in the engine's
own per-step metadata, and replayed there in order. Plain numpy arrays and tuples:
they pickle small and carry no tensors."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

from ..transfer import ROUTES, Route

__all__ = ["LOAD", "SAVE", "Fetch", "Job", "LoadPlan", "Prompt", "SavePlan", "TierPlan", "Transfers"]

LOAD, SAVE = "load", "save"


@dataclass(frozen=True, slots=True)
class TierPlan:
    """The blocks of kvdist's tiers on every worker rank (the capacities the ranks
    committed at start-up: ``ExternalCache.tier_plan``), which the planner numbers its
    slots in. ``gpu`` is never kvdist's: the engine's blocks."""

    host_blocks: int
    disk_blocks: int


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt as the planner matches it: its length and the chained 128-bit hashes of
    its full blocks (``ExternalPlanner.prompt``: kvdist's own, from the tokens; or the
    engine's block keys, ``ExternalPlanner.prompt_of_keys``)."""

    num_tokens: int
    hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Job:
    """One request's load or save: the engine blocks it writes (a load) or reads (a
    save), and for a load the engine blocks ``lookup`` promised that it cannot fill
    (their blocks left kvdist meanwhile): the engine must compute those again."""

    request_id: Hashable
    kind: str  # LOAD or SAVE
    blocks: tuple[int, ...]
    failed: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """What ``ExternalPlanner.plan_load`` queued: ``blocks`` (engine block ids, in
    prompt order) receive kvdist's blocks; ``failed`` were promised by ``lookup`` and
    are not loaded (report them to the engine, which recomputes them)."""

    request_id: Hashable
    blocks: tuple[int, ...]
    failed: tuple[int, ...]
    tokens: int  # tokens the loaded blocks hold
    remote: int = 0  # of ``blocks``, the last ones fetched from other replicas (asynchronous)


@dataclass(frozen=True, slots=True)
class SavePlan:
    """What ``ExternalPlanner.plan_save`` queued: copies out of ``blocks`` (engine block
    ids). The engine must not reuse them until a worker reports the save finished;
    ``held`` blocks kvdist had already and ``dropped`` ones found no slot."""

    request_id: Hashable
    blocks: tuple[int, ...]
    held: int
    dropped: int


@dataclass(frozen=True, slots=True)
class Fetch:
    """One load job's blocks that another replica holds (``cache.gpu: external`` with
    ``distributed.remote``): block ``i`` is fetched from replica ``peers[i]``'s host slot
    ``slots[i]``, where the directory listed the block of hash ``hashes[i]``, into engine
    block ``blocks[i]`` (``kvdist.external.peers``). ``job`` indexes ``Transfers.jobs``."""

    job: int
    peers: tuple[int, ...]
    slots: tuple[int, ...]
    hashes: tuple[int, ...]
    blocks: tuple[int, ...]


def _ints(values: list[int], dtype) -> np.ndarray:
    return np.asarray(values, dtype=dtype).reshape(-1)


@dataclass(frozen=True, slots=True)
class Transfers:
    """The copies the planner queued since its last ``take``, in the order they must be
    issued (rule S2 is applied to them on each worker, in this order): ``route[i]``
    indexes ``kvdist.transfer.ROUTES``; ``src[i]``/``dst[i]`` are tier-local slots,
    engine block ids on the GPU side; ``job[i]`` indexes ``jobs`` (-1: an eviction's
    demotion, no request's). ``tiers``: what the planner numbered slots in."""

    tiers: TierPlan
    route: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    src: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    dst: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    job: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    jobs: tuple[Job, ...] = ()
    # The host slots the copies fill, with the hash each then holds, in row order: the
    # holder's stamps and directory records (remote tier). ``filled[i] = (local slot, hash)``.
    filled: tuple[tuple[int, int], ...] = ()
    fetches: tuple[Fetch, ...] = ()  # blocks loaded from other replicas (after the copies)

    @classmethod
    def of(cls, tiers: TierPlan, copies: list[tuple[int, int, int, int]], jobs: list[Job],
           filled: list[tuple[int, int]] = (), fetches: list[Fetch] = ()) -> Transfers:
        """From (route index, src, dst, job) rows."""
        cols = list(zip(*copies)) if copies else [[], [], [], []]
        return cls(tiers, _ints(cols[0], np.uint8), _ints(cols[1], np.int64), _ints(cols[2], np.int64),
                   _ints(cols[3], np.int32), tuple(jobs), tuple(filled), tuple(fetches))

    def __len__(self) -> int:
        """Copies and fetched blocks."""
        return len(self.route) + sum(len(f.blocks) for f in self.fetches)

    def routes(self) -> list[Route]:
        return [ROUTES[i] for i in self.route.tolist()]
