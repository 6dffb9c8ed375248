"""``python -m kvdist bench drills``: the start-up fault drills on this job's ranks.

Each drill sets ``KVDIST_FAULTS`` on every rank and runs ``kvdist.create()`` (then
``close()``): a healthy start from a cold process and again warm, the host tier failing
on one rank (USE_NO_HOST everywhere), the build failing on one rank (ABORT everywhere),
and last the last rank stalling before the first collective (consensus timeout cut to
``--stall-timeout`` seconds: every rank raises ConsensusTimeout, the stalled one after
its sleep). Rank 0 prints each rank's outcome and create() seconds split into tier
allocation (build), consensus, teardown and planning, and the disk tier's files left
behind (none, after any outcome). Run it under the launcher with a real config:

    launch/kvdist-launch -n 4 bench drills --config my-gpu.yaml"""

from __future__ import annotations

import argparse
import os
import time
import warnings

from tabulate import tabulate

from ..cache import create
from ..config import CacheConfig, load_config
from ..distributed.comm import resolve
from ..faults import ENV

PARTS = ("build", "consensus", "teardown", "plan")


def drills(ranks: int, stall_timeout: float) -> list[tuple[str, str, dict]]:
    """(name, KVDIST_FAULTS, config changes) of each drill for a job of ``ranks``."""
    last = ranks - 1
    host, build = min(1, last), min(2, last)
    return [("healthy, cold process", "", {}), ("healthy, warm", "", {}),
            (f"host tier fails on rank {host}", f"host_tier@{host}", {}),
            (f"build fails on rank {build}", f"build@{build}", {}),
            (f"rank {last} stalls (timeout {stall_timeout:g} s)", f"stall@{last}",
             {"distributed": {"consensus_timeout_s": stall_timeout}})]


def attempt(cfg: CacheConfig) -> tuple[str, float, dict]:
    """(outcome, wall seconds, init_seconds) of one create() and close() on this rank."""
    t0 = time.perf_counter()
    try:
        cache = create(cfg)
    except Exception as e:  # noqa: BLE001 - every outcome is reported, none is fatal
        return f"{type(e).__name__}: {str(e)[:48]}", time.perf_counter() - t0, getattr(e, "init_seconds", {})
    wall = time.perf_counter() - t0
    seconds = cache.stats()["init_seconds"]
    outcome = f"{cache.init_status.name} {'+'.join(cache.tiers)}"
    cache.close()
    return outcome, wall, seconds


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvdist bench drills", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="YAML config to start (give it a host and a disk tier)")
    p.add_argument("--stall-timeout", type=float, default=5.0,
                   help="consensus_timeout_s of the stall drill (default 5)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cfg = load_config(args.config)
    disk_dir = cfg.cache.disk.path if cfg.cache.disk.bytes else None
    comm = resolve()
    warnings.simplefilter("ignore")  # the USE_NO_HOST drill warns on purpose
    try:
        for name, faults, changes in drills(comm.size, args.stall_timeout):
            os.environ[ENV] = faults
            comm.barrier("drill")
            outcome, wall, seconds = attempt(cfg.replace(**changes) if changes else cfg)
            row = [comm.rank, outcome, wall] + [seconds.get(k, float("nan")) for k in PARTS]
            rows = comm.allgather(row, "drill outcomes")
            if comm.rank == 0:
                print(f"\n== {name} ({ENV}={faults!r}), {comm.size} ranks")
                print(tabulate(rows, headers=["rank", "outcome", "create s", "alloc (build) s", "consensus s",
                                              "teardown s", "plan s"], floatfmt=".3f"))
                if disk_dir:
                    print("disk files left:", sorted(os.listdir(disk_dir)))
    finally:
        os.environ.pop(ENV, None)
        comm.free()
    return 0
