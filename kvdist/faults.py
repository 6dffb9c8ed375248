"""Fault drills: ``KVDIST_FAULTS="site@rank[,site@rank...]"`` makes the named rank fail
at the named site, to rehearse failures on a real job (docs/design.md, "Start-up").

Sites: ``host_tier`` (the host tier cannot be had → HostTierUnavailable), ``build``
(any other error while building the local cache), ``fallback_build`` (error while
rebuilding without the host tier), ``stall`` (the rank never reaches the consensus
collective), ``remote_stall`` (the same at the remote tier's commit collective, while
every rank's host tier file and the node directory are in /dev/shm), ``run_setup``
(the main job's run fails on that rank in its own set-up, after the cache and the
model are built, while its peers go on to the first step), ``remote_fetch`` (every
fetch of the remote tier fails on that rank: its replica must then reuse none of
those blocks, rule R1), ``external_load`` (with ``cache.gpu: external``, that rank's
loads are not issued and their engine blocks are reported failed, so the engine
recomputes them). ``site@*`` fails every rank.

Where each site fires: ``build`` and ``host_tier`` while the local candidate is built
(the latter only when a host tier is planned), ``fallback_build`` while it is rebuilt
without the host tier after USE_NO_HOST, ``stall`` after the local build, just before
the phase-1 collective, ``remote_stall`` after the remote tier is built, just before its
commit, ``run_setup`` just before the run's report is set up. A stalled rank sleeps
for :func:`stall_seconds` — longer than its peers wait at the consensus — then tears
its candidate down and raises ConsensusTimeout itself, so a drill under ``mpiexec``
still ends on every rank."""

from __future__ import annotations

import os
import time

from .errors import ConfigError, ConsensusTimeout, HostTierUnavailable, KVDistError

SITES = ("host_tier", "build", "fallback_build", "stall", "remote_stall", "run_setup", "remote_fetch",
         "external_load")
STALLS = ("stall", "remote_stall")
ENV = "KVDIST_FAULTS"


def parse(spec: str) -> dict[str, set[int] | None]:
    """``{site: ranks}``; ranks None means every rank."""
    out: dict[str, set[int] | None] = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        site, sep, rank = item.partition("@")
        if site not in SITES or not sep:
            raise ConfigError(ENV, item, f"expected site@rank with site one of {', '.join(SITES)}")
        if rank == "*":
            out[site] = None
            continue
        try:
            r = int(rank)
        except ValueError:
            raise ConfigError(ENV, item, "the rank must be an int or *") from None
        ranks = out.setdefault(site, set())
        if ranks is not None:
            ranks.add(r)
    return out


def active(site: str, rank: int, spec: str | None = None) -> bool:
    """Whether the drill asks ``rank`` to fail at ``site``."""
    assert site in SITES, f"unknown fault site {site!r}"
    faults = parse(os.environ.get(ENV, "") if spec is None else spec)
    if site not in faults:
        return False
    ranks = faults[site]
    return ranks is None or rank in ranks


def inject(site: str, rank: int) -> None:
    """Raise the drill's error for ``site`` if it is active on ``rank``."""
    assert site not in STALLS, "a stall is not an error: use stall()"
    if not active(site, rank):
        return
    if site == "host_tier":
        raise HostTierUnavailable(f"fault drill {ENV}: host tier unavailable on rank {rank}")
    raise KVDistError(f"fault drill {ENV}: {site} failed on rank {rank}")


def stall_seconds(timeout_s: float) -> float:
    """How long a stalled rank sleeps: well past its peers' ``timeout_s``, so they give
    up first even when their builds were slower than this rank's."""
    return 1.5 * timeout_s + min(2.0, timeout_s)


def stall(site: str, rank: int, timeout_s: float) -> None:
    """If the drill stalls ``rank`` at ``site`` (one of STALLS): sleep past the peers'
    deadline, then raise ConsensusTimeout without ever entering the collective."""
    assert site in STALLS, f"{site!r} is not a stall"
    if not active(site, rank):
        return
    seconds = stall_seconds(timeout_s)
    time.sleep(seconds)
    if site == "stall":
        raise ConsensusTimeout(
            f"fault drill {ENV}: rank {rank} stalled for {seconds:g} s before the consensus "
            f"collective; its peers gave up after {timeout_s:g} s")
    raise ConsensusTimeout(f"fault drill {ENV}: rank {rank} stalled for {seconds:g} s before the "
                           f"remote tier's commit collective")
