"""``python -m kvdist bench consensus``: how long the start-up takes on this job's ranks.

Every rank runs ``kvdist.create()`` then ``close()``, ``--rounds`` times (rounds start
together, after a barrier), and rank 0 prints, for each part of ``create()`` — planning,
tier allocation (build), consensus (communicator set-up and every collective, waiting
for the slowest rank included) and the total — the median and the worst over rounds
of the slowest rank. Run it under the launcher to time your own nodes:

    launch/kvdist-launch -n 8 --hostfile hosts --ppn 4 bench consensus --rounds 20

The default config is a small CPU cache without a disk tier (what is timed is the
protocol, not the allocation); ``--config FILE`` times a real one, tiers and all."""

from __future__ import annotations

import argparse
import json
import statistics

from tabulate import tabulate

from ..cache import create
from ..config import load_config
from ..distributed.comm import resolve

PARTS = ("plan", "build", "consensus", "total")
SMALL = {"model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32"},
         "cache": {"tokens_per_block": 16, "device": "cpu", "gpu": {"blocks": 64}, "host": {"bytes": "1MiB"}},
         "distributed": {"consensus_timeout_s": 60}}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvdist bench consensus", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20, help="create/close rounds (default 20)")
    p.add_argument("--config", default=None, help="YAML config to start (default: a small CPU cache)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p


def measure(cfg, rounds: int) -> tuple[int, dict, list[dict[str, float]]]:
    """On every rank: its rank, the node layout, and per round the slowest rank's
    seconds per part of create()."""
    c = resolve()
    try:
        rank, layout = c.rank, {"ranks": c.size, "nodes": c.node.num_nodes}
        slowest = []
        for _ in range(rounds):
            c.barrier("bench round")
            cache = create(cfg)
            mine = cache.stats()["init_seconds"]
            cache.close()
            everyone = c.allgather(mine, "bench timings")
            slowest.append({part: max(t[part] for t in everyone) for part in PARTS})
        return rank, layout, slowest
    finally:
        c.free()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.rounds < 1:
        _parser().error("--rounds must be at least 1")
    cfg = load_config(args.config if args.config else SMALL)
    rank, layout, rounds = measure(cfg, args.rounds)
    if rank != 0:
        return 0
    summary = {part: {"median_ms": 1e3 * statistics.median(r[part] for r in rounds),
                      "max_ms": 1e3 * max(r[part] for r in rounds)} for part in PARTS}
    if args.json:
        print(json.dumps({**layout, "rounds": args.rounds, "config": args.config or "small", **summary}))
        return 0
    print(f"bench consensus: {layout['ranks']} ranks on {layout['nodes']} node(s), {args.rounds} rounds, "
          f"config {args.config or 'small CPU cache'}; the slowest rank of each round")
    print(tabulate([[part, f"{s['median_ms']:.2f}", f"{s['max_ms']:.2f}"] for part, s in summary.items()],
                   headers=["part of create()", "median ms", "worst ms"]))
    return 0
