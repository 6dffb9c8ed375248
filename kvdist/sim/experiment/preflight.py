"""What the main job checks before it builds anything, so that an operator's mistake
costs a second and one line, not a whole run: ``--out`` can take the results, the
metrics port can be bound. And how a failed start reaches the command line."""

from __future__ import annotations

from ... import paths
from ...distributed import comm as dist_comm
from ...errors import ConfigError, KVDistError
from .metrics import MetricsServer


class StartupFailed(Exception):
    """``create`` failed on every rank (its error, or ConsensusAbort naming the
    failed ranks, is ``cause``); nothing is left allocated."""

    def __init__(self, cause: KVDistError):
        self.cause = cause
        super().__init__(str(cause))


def preflight(comm, out: str | None, port: int | None, host: str) -> MetricsServer | None:
    """Rank 0 of ``comm`` (the job) checks ``out`` and binds the metrics endpoint
    (returned, serving); every rank then raises the same ConfigError if either failed
    (collective, over a communicator of its own)."""
    c = dist_comm.resolve(comm)
    problem, server = None, None
    if c.rank == 0:
        why = None if out is None else paths.files_problem(out)
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
