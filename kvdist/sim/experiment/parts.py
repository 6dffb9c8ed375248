"""What one run of the main job is made of (``RunParts``), built before it starts:
the checks before anything (``preflight``) and the cache (``open_cache``), every
rank's device and this rank's model (``engine``), and how they are freed
(``close_parts``). ``job`` and ``replica_job`` build them differently."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch

from ...cache import KVCache, create
from ...config import CacheConfig
from ...distributed import stall
from ...dtypes import torch_dtype
from ...errors import KVDistError
from ..engine.model import Decoder, Geometry, compute_dtype_for
from ..engine.parallel import TensorParallel
from ..engine.scheduler import Scheduler
from .admission import PrefetchGate
from .clock import StepTime
from .metrics import MetricsServer
from .options import RunOptions
from .placement import Placement, placements
from .preflight import StartupFailed, preflight
from .workload import Trace

__all__ = ["Closing", "RunParts", "abandon", "close_parts", "engine", "open_cache"]


class Closing(Protocol):
    """What a run closes along with its parts (its reporter)."""

    def close(self) -> None: ...


@dataclass(slots=True)
class RunParts:
    """What one run is made of, built before it starts (and closed by it)."""

    cache: KVCache
    tp: TensorParallel  # the model's communicator
    trace: Trace  # the requests this rank's scheduler serves
    sched: Scheduler
    clock: StepTime  # StepTime, RealTime or WallSteps
    model: Decoder
    placement: list[Placement]  # every rank's device
    server: MetricsServer | None = None  # rank 0's metrics endpoint
    look_ahead: bool = True  # prefetch for Scheduler.upcoming (False: the scheduler's gate does)
    run_ahead: bool = False  # prepare step N+1 while step N's forward pass runs
    # The scheduler's gate, when the driver's look-ahead goes through it too (a request
    # prefetched once; the gate's prefetches timed as the step's "prefetch" call).
    gate: PrefetchGate | None = None
    # A replica's: the whole job's communicator, through which a replica that stops on a
    # signal tells the others (point to point: no collective spans replicas, R3).
    world: TensorParallel | None = None


def abandon(cache: KVCache, server: MetricsServer | None, parts: RunParts | None,
            error: BaseException) -> None:
    """Undo a run's set-up that failed with ``error`` (which the caller raises): its
    parts once built, else the cache and server. The failure may be this rank's alone
    (its report's set-up): its peers are then on their way to the first step, not
    here, so nothing waits for them, and they are told (``stall.fail_alone``): each
    raises PeerFailed at once rather than wait out the first step's deadline."""
    stall.fail_alone(error, "the run's set-up", cache.rank)
    if parts is not None:
        close_parts(parts, wait_for_peers=False)
        return
    if server is not None:
        server.close()
    cache.close(wait_for_peers=False)


def close_parts(parts: RunParts, reporter: Closing | None = None, wait_for_peers: bool = True) -> None:
    """Free a run's parts (collective: the cache's and the model's communicators, unless
    not ``wait_for_peers``: ``KVCache.close``)."""
    try:
        if parts.server is not None:
            parts.server.close()
            parts.server = None
        if reporter is not None:
            reporter.close()
    finally:
        try:
            parts.cache.close(wait_for_peers=wait_for_peers)
        finally:
            parts.tp.free()


def open_cache(cfg: CacheConfig, opts: RunOptions, comm) -> tuple[MetricsServer | None, KVCache]:
    """The checks before anything is built, then the cache (collective): a failure is
    ``StartupFailed``, with nothing left open."""
    server = preflight(comm, opts.out, opts.metrics_port, opts.metrics_host)
    try:
        return server, create(cfg, comm=comm)
    except BaseException as e:
        if server is not None:
            server.close()
        if isinstance(e, KVDistError):
            raise StartupFailed(e) from e
        raise


def engine(cfg: CacheConfig, cache: KVCache, tp: TensorParallel, comm, model: Decoder | None
           ) -> tuple[list[Placement], Decoder]:
    """Every rank's device (collective) and this rank's model (``model``: one built
    already, which ``compare`` shares between configurations)."""
    me_rank, placement = placements(cfg.cache.device, comm)
    me = placement[me_rank]
    assert me.device == str(cache.device), f"placement {me.device} but the cache is on {cache.device}"
    # On CPU the tiny model's matmuls are too small to gain from intra-op threads, and
    # threads of ranks sharing cores spin against each other (15x slower seen).
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(1 if cache.device.type == "cpu" else max(1, cores // me.local_size))
    w, layout = cfg.workload, cache.layout
    if model is None:
        model = Decoder(Geometry.from_config(cfg), seed=w.seed, tp=tp, device=cache.device,
                        kv_dtype=torch_dtype(layout.dtype), tokens_per_block=layout.tokens_per_block,
                        compute_dtype=compute_dtype_for(w.compute_dtype, cache.device))
        if w.cuda_graphs and model.can_capture():
            model.capture_graphs()
    assert model.device == cache.device, f"model on {model.device}, cache on {cache.device}"
    return placement, model
