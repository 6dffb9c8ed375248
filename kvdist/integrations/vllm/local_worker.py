"""The worker-side connector's remote tier, for the scheduler-side connector of the same
process. With the remote tier (``distributed.remote``) each planner looks blocks of
other replicas up in its worker rank's directory, which the TP group keeps equal on
every rank (rule R4), so every rank's scheduler must run in its worker's process:
vLLM's ``external_launcher`` (one engine per process, under ``mpiexec``). vLLM hands the
scheduler no handle on its workers; the worker offers its rank's remote tier here when
it registers its KV caches (before vLLM builds the scheduler), and the scheduler takes
it when it adopts the workers' tiers (``SchedulerSide.adopt``)."""

from __future__ import annotations

__all__ = ["offer", "take", "withdraw"]

from ...external.peers import PeerTier

_offered: list[PeerTier | None] = []  # what this process's worker committed (None: remote tier off)


def offer(peers: PeerTier | None) -> None:
    """This process's worker registered its KV caches: its remote tier (None: off)."""
    _offered[:] = [peers]


def take() -> tuple[bool, PeerTier | None]:
    """(whether a worker of this process registered, its remote tier)."""
    return (True, _offered[0]) if _offered else (False, None)


def withdraw(peers: PeerTier | None) -> None:
    """This process's worker shut down: a scheduler built later in this process (a new
    engine) finds no worker beside it until the next one registers."""
    if _offered and _offered[0] is peers:
        _offered.clear()
