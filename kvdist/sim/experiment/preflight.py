"""What the main job checks before it builds anything, so that an operator's mistake
costs a second and one line, not a whole run: the run fits each rank's memory and its
model can write the K/V dtype (``budget``), ``--out`` can take the results, the
metrics port can be bound. And how a failed start reaches the command line."""

from __future__ import annotations

import os

from ... import paths
from ...config import CacheConfig
from ...distributed import comm as dist_comm
from ...distributed.replicas import ReplicaLayout
from ...errors import ConfigError, KVDistError
from ...storage.host_sizing import available_memory
from .budget import Budget, check_run
from .metrics import MetricsServer

_COMPUTE_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


class StartupFailed(Exception):
    """``create`` failed on every rank (its error, or ConsensusAbort naming the
    failed ranks, is ``cause``); nothing is left allocated."""

    def __init__(self, cause: KVDistError):
        self.cause = cause
        super().__init__(str(cause))


def latest_problem(out: str) -> str | None:
    """Why ``<out>/latest`` could not be pointed at the run (``report.point_latest``
    replaces a symlink only), or None."""
    latest = os.path.join(out, "latest")
    if os.path.islink(latest) or not os.path.lexists(latest):
        return None
    what = "a directory" if os.path.isdir(latest) else "a file"
    return f"{latest} is {what}, not the symlink a run points at its results (move it away)"


def preflight(comm, out: str | None, port: int | None, host: str) -> MetricsServer | None:
    """Rank 0 of ``comm`` (the job) checks ``out`` and binds the metrics endpoint
    (returned, serving); every rank then raises the same ConfigError if either failed
    (collective, over a communicator of its own)."""
    c = dist_comm.resolve(comm)
    problem, server = None, None
    if c.rank == 0:
        why = None if out is None else paths.files_problem(out) or latest_problem(out)
        if why is not None:
            problem = ("--out", out, f"results cannot be written there: {why}")
        elif port is not None:
            try:
                server = MetricsServer(port, host)
            except (OSError, OverflowError) as e:
                problem = ("--metrics-port", port,
                           f"cannot serve metrics on {host}:{port}: {getattr(e, 'strerror', None) or e}")
    try:
        problem = c.allgather(problem, "preflight")[0]
    finally:
        c.free()
    if problem is not None:
        raise ConfigError(*problem)
    return server


def check_run_size(cfg: CacheConfig, requests: int | None, comm=None) -> None:
    """Every rank estimates the run's trace and model against its own memory
    (``budget.check_run``); all raise the same ConfigError, the lowest failing rank's,
    if any cannot hold them. Collective over ``comm`` (None: the whole job)."""
    c = dist_comm.resolve(comm, cfg.distributed.consensus_timeout_s)
    try:
        ranks = ReplicaLayout.of(c.rank, c.size, cfg.distributed.tp_size).tp_size  # or its mistake, first
        problem = check_run(cfg, requests, ranks, _budget(cfg, c.local_rank, c.local_size))
        problems = c.allgather(problem, "run size")
    finally:
        c.free()
    first = next((p for p in problems if p is not None), None)
    if first is not None:
        raise ConfigError(*first)


def _budget(cfg: CacheConfig, local_rank: int, local_size: int) -> Budget:
    """This rank's memory for the trace and the model: host memory shared by the
    node's ranks; on CUDA, the device's free memory less the GPU tier."""
    host = available_memory() // max(local_size, 1)
    name = cfg.workload.compute_dtype
    if cfg.cache.device == "cpu":
        return Budget(host, local_size, None, _COMPUTE_ITEMSIZE.get(name, 4))
    import torch

    from ...candidate import cuda_free_bytes, select_device
    from ...layout import KVLayout

    try:
        device = select_device(cfg.cache.device, local_rank)
    except ConfigError:  # the cache's start names it, on every rank
        device = torch.device("cpu")
    if device.type != "cuda":
        return Budget(host, local_size, None, _COMPUTE_ITEMSIZE.get(name, 4))
    free = cuda_free_bytes(device)
    gpu = cfg.cache.gpu
    tier = (gpu.blocks * KVLayout.from_config(cfg).bytes_per_block if gpu.blocks is not None
            else gpu.bytes if gpu.bytes is not None else int(free * (gpu.memory_fraction or 0)))
    return Budget(host, local_size, max(0, free - tier), _COMPUTE_ITEMSIZE.get(name, 2))
