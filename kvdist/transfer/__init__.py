"""Moving blocks between tiers: per-slot ordering (rules S1, S2), step barriers (S4,
S5), batching, and the executors that do the copies (immediate, simulated-async on
CPU, CUDA streams) under one contract (``contract.Executor``)."""

from .contract import Event, Executor, ExecutorCounters, SimulatedCompute
from .engine import ALL_RULES, EngineSeams, TransferEngine
from .executors import BatchLog, Copies, HostCopies, NullExecutor, SyncExecutor
from .routes import DEMOTE, OFFLOAD, ONBOARD, PROMOTE, RELOAD, ROUTE_NAMES, ROUTES, SPILL, Route, route
from .simulated import SimDeadlock, SimExecutor

__all__ = ["ALL_RULES", "DEMOTE", "RELOAD", "OFFLOAD", "ONBOARD", "PROMOTE", "ROUTES", "ROUTE_NAMES", "SPILL",
           "BatchLog", "Copies", "EngineSeams", "Event", "Executor", "ExecutorCounters", "HostCopies",
           "NullExecutor", "Route", "SimDeadlock", "SimExecutor", "SimulatedCompute", "SyncExecutor",
           "TransferEngine", "route"]
