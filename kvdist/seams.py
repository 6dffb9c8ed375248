"""Test seams: everything a test or benchmark may change or watch inside a cache, in one
object handed to the build (``kvdist.testing.create(cfg, seams)``), never patched onto
a live cache. A cache built by ``kvdist.create`` has none.

Switches (read once, at construction): the ordering rules the transfer engine
enforces and the remote tier's (rule-off cases show what each rule prevents), S3's
staging protection, the initial size of the host block table, the CUDA copy path.
Records (appended to while the cache runs): every batch an executor runs, the size of
every bulk copy. Handles (set by the build): the rank's parts and its remote tier, for
white-box assertions on exact slots and for holding its directory messages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .distributed.remote_rules import REMOTE_RULES
from .staging.rows import DEFAULT_ROWS
from .staging.stager import DEFAULT_SLOTS
from .transfer import ALL_RULES, BatchLog, EngineSeams

if TYPE_CHECKING:
    from .distributed.comm import MpiComm, SingleComm
    from .distributed.remote import RemoteTier
    from .manager import CacheManager
    from .rank_cache import RankCache
    from .staging import Stager
    from .storage import DiskPool, GpuPool, HostPool
    from .transfer import Executor, TransferEngine

__all__ = ["Seams"]


@dataclass
class Seams:
    # -- switches ----------------------------------------------------------------------------
    rules: frozenset[str] = ALL_RULES  # of S2, S4, S5: the ones the transfer engine enforces
    tracking: str = "slot"  # S1: "slot"; "block" (by block id), "local" (tier-local index) are bugs
    protect_staging: bool = True  # S3: False is one staging buffer, rewritten under queued copies
    staging_slots: int = DEFAULT_SLOTS  # S3: the staging ring's host buffers (1 at the least)
    table_rows: int = DEFAULT_ROWS  # initial rows of the host block table (it grows)
    copy_path: str | None = None  # CUDA: force "memcpy-batch", "runs" or "per-block"
    remote_rules: frozenset[str] = REMOTE_RULES  # of R1, R2, R4: the ones the remote tier enforces
    # -- records -----------------------------------------------------------------------------
    batch_log: BatchLog | None = None  # each batch run: (route name, tier-local src, dst)
    copy_many_sizes: list[int] | None = None  # the length of each bulk copy the manager queued
    # -- handles (set by the build; the last candidate built is the committed one) -----------
    rank_cache: RankCache | None = field(default=None, init=False)
    comm: SingleComm | MpiComm | None = field(default=None, init=False)
    remote: RemoteTier | None = field(default=None, init=False)  # the committed remote tier

    def engine_seams(self) -> EngineSeams:
        return EngineSeams(rules=self.rules, tracking=self.tracking, copy_many_sizes=self.copy_many_sizes)

    @property
    def manager(self) -> CacheManager:
        return self.rank_cache.manager

    @property
    def engine(self) -> TransferEngine:
        return self.rank_cache.manager.engine

    @property
    def executor(self) -> Executor:
        return self.rank_cache.backend.executor

    @property
    def stager(self) -> Stager:
        return self.rank_cache.stager

    @property
    def gpu(self) -> GpuPool:
        return self.rank_cache.gpu

    @property
    def host(self) -> HostPool | None:
        return self.rank_cache.host

    @property
    def disk(self) -> DiskPool | None:
        return self.rank_cache.disk
