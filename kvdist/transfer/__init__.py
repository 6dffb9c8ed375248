"""Moving blocks between tiers: per-slot ordering (rules S1, S2), step barriers (S4,
S5), batching, and the executors that do the copies (immediate, simulated-async on
CPU, CUDA streams)."""

from .engine import ALL_RULES, DIRECTIONS, TransferEngine
from .executors import HostCopies, SyncExecutor
from .simulated import SimDeadlock, SimExecutor

__all__ = ["ALL_RULES", "DIRECTIONS", "HostCopies", "SimDeadlock", "SimExecutor",
           "SyncExecutor", "TransferEngine"]
