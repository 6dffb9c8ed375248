"""The options of a run that are not the cache's configuration (``python -m kvdist run``'s
flags): how many requests, where results go, the metrics endpoint, what is compared."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RunOptions"]


@dataclass(slots=True)
class RunOptions:
    requests: int | None = None  # overrides workload.requests
    out: str | None = "runs"  # None: write no run directory
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"  # the interface the metrics endpoint listens on
    progress: bool = True
    compare: bool | None = None  # run in real time, once per configuration; None: on CUDA
    configs: tuple[str, ...] = ("all-tiers", "gpu-only", "no-reuse")  # compared (compare.CONFIGS)
