"""How much host memory one rank may pin: the node's limits, read once, and the
per-rank size of ``cache.host.bytes: auto``.

The ranks of one node share its memory: a tier sized from the whole node on every
rank gets the node OOM-killed. The rank count per node is an input (the
communicator knows it); the MIN-reduce across ranks happens in ``dist``."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

from ..units import gib

# Share of RLIMIT_MEMLOCK the tier may take: the rest stays for the engine's own
# locked buffers (NCCL, RDMA registrations).
MEMLOCK_SHARE = 0.8
_CAP_IPC_LOCK = 14  # bit of CapEff in /proc/self/status


@dataclass(slots=True, frozen=True)
class HostLimits:
    """What the node lets this process have, in bytes. ``memlock`` is None when the
    memlock limit does not bind (unlimited, or the process holds CAP_IPC_LOCK)."""

    available: int
    memlock: int | None

    def describe(self) -> str:
        lock = "unlimited" if self.memlock is None else f"{self.memlock} bytes"
        return f"MemAvailable {self.available} bytes, memlock {lock}"


def available_memory() -> int:
    """MemAvailable of /proc/meminfo in bytes (free physical pages as a fallback)."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def has_ipc_lock() -> bool:
    """Whether the process holds CAP_IPC_LOCK, which exempts it from RLIMIT_MEMLOCK."""
    try:
        with open("/proc/self/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_IPC_LOCK & 1)
    except (OSError, ValueError):
        pass
    return False


def memlock_limit() -> int | None:
    """The soft RLIMIT_MEMLOCK in bytes, or None when it does not bind."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or has_ipc_lock():
        return None
    return soft


def read_limits() -> HostLimits:
    return HostLimits(available=available_memory(), memlock=memlock_limit())


@dataclass(slots=True, frozen=True)
class AutoHostSize:
    """The result of ``host.bytes: auto``: the bytes, which bound won, and every bound
    (for the log line an operator reads when the tier is smaller than expected)."""

    nbytes: int
    bound: str
    bounds: dict[str, int]

    def describe(self) -> str:
        parts = ", ".join(f"{k} {gib(v)}" for k, v in self.bounds.items())
        return f"host tier auto size {gib(self.nbytes)} per rank, bound by {self.bound} ({parts})"


def auto_host_bytes(gpu_bytes: int, local_ranks: int, *, memory_fraction: float, gpu_ratio: float,
                    pinned: bool, check_memlock: bool = True,
                    limits: HostLimits | None = None) -> AutoHostSize:
    """Per-rank host tier bytes: the least of available memory x ``memory_fraction``
    shared by the node's ``local_ranks``, the memlock limit x 0.8 (when the tier is
    pinned and the limit binds), and the GPU tier x ``gpu_ratio``."""
    assert local_ranks >= 1, f"local_ranks must be >= 1, got {local_ranks}"
    assert gpu_bytes >= 0, f"gpu_bytes must be >= 0, got {gpu_bytes}"
    limits = read_limits() if limits is None else limits
    bounds = {"memory": int(limits.available * memory_fraction) // local_ranks,
              "gpu": int(gpu_bytes * gpu_ratio)}
    if pinned and check_memlock and limits.memlock is not None:
        bounds["memlock"] = int(limits.memlock * MEMLOCK_SHARE)
    bound = min(bounds, key=bounds.__getitem__)
    return AutoHostSize(bounds[bound], bound, bounds)
