"""Two nodes vs one node, side by side: start-up consensus and the main job's step time
of 4 ranks as 2 nodes x 2 (the test bed: MPI over TCP on the veth pair between the
nodes) and as 1 node x 4 (shared memory only), under MPICH and Open MPI.

    .venv/bin/python -m tests.nodes.bench [--rounds 20] [--requests 60] [--json]

Both layouts start from node a of the same bed with ``launch/kvdist-launch`` (with and
without ``--hostfile``), one after the other; consensus is ``bench consensus`` (median
over rounds of the slowest rank), the main job is ``run`` on configs/default.yaml with
its disk tier on the nodes' scratch. The nodes share this machine's cores: the ratio
shows what TCP between hosts costs against shared memory, not a real network."""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from tabulate import tabulate

from tests.nodes import jobs
from tests.nodes.testbed import BedUnavailable, TwoNodes, signals_unwind

LAYOUTS = {"one node": False, "two nodes": True}


def consensus_ms(bed: TwoNodes, flavor: str, two_nodes: bool, rounds: int) -> float:
    out = jobs.launch(bed, flavor, "bench", "consensus", "--rounds", str(rounds), "--json",
                      two_nodes=two_nodes)
    if out.returncode != 0:
        raise RuntimeError(f"bench consensus ({flavor}): {out.stderr[-2000:]}")
    line = next(x for x in out.stdout.splitlines() if x.startswith("{"))
    got = json.loads(line)
    assert got["nodes"] == (2 if two_nodes else 1), got
    return got["consensus"]["median_ms"]


def main_job(bed: TwoNodes, flavor: str, two_nodes: bool, requests: int) -> dict[str, float]:
    out_dir = bed.root / f"bench-{flavor}-{int(two_nodes)}"
    cfg = jobs.job_config(bed)
    out = jobs.launch(bed, flavor, "run", "--config", str(cfg), "--requests", str(requests), "--out",
                      str(out_dir), "--quiet", two_nodes=two_nodes, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"main job ({flavor}): {out.stderr[-2000:]}")
    r = json.loads((out_dir / "latest" / "results.json").read_text(encoding="utf-8"))
    assert r["ok"] and r["nodes"] == (2 if two_nodes else 1), r
    return {"step_ms": 1e3 * r["seconds"] / r["steps"], "model_ms": r["model_ms_per_step"],
            "cache_us": r["cache_api_us_per_step"], "steps": r["steps"]}


def measure(bed: TwoNodes, flavors: list[str], rounds: int, requests: int, repeat: int) -> dict:
    """Per (MPI, layout): the median over ``repeat`` interleaved repetitions of each figure."""
    runs: dict = {}
    for i in range(repeat):
        for flavor in flavors:
            for layout, two in LAYOUTS.items():
                print(f"bench: {flavor}, {layout} ({i + 1}/{repeat}) ...", file=sys.stderr, flush=True)
                figures = {"consensus_ms": consensus_ms(bed, flavor, two, rounds),
                           **main_job(bed, flavor, two, requests)}
                runs.setdefault((flavor, layout), []).append(figures)
    return {key: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for key, rs in runs.items()}


def render(results: dict, flavors: list[str], rounds: int, requests: int) -> str:
    rows = []
    what = {"consensus_ms": f"consensus, ms (median of {rounds} rounds)",
            "step_ms": "main job: ms per step",
            "model_ms": "  of which the TP model (an allreduce per layer)",
            "cache_us": "  cache calls, µs per step"}
    for flavor in flavors:
        one, two = results[flavor, "one node"], results[flavor, "two nodes"]
        for key, label in what.items():
            rows.append([flavor, label, f"{one[key]:.2f}", f"{two[key]:.2f}", f"{two[key] / one[key]:.2f}"])
    head = (f"4 ranks: one node (4) vs two nodes (2 + 2) of the test bed; main job: {requests} requests, "
            f"{results[flavors[0], 'one node']['steps']:.0f} steps; medians of repetitions interleaved "
            "one node / two nodes")
    return head + "\n" + tabulate(rows, headers=["MPI", "", "one node", "two nodes", "two / one"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.nodes.bench", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20, help="consensus rounds per layout (default 20)")
    p.add_argument("--requests", type=int, default=60, help="main-job requests per layout (default 60)")
    p.add_argument("--mpi", default="mpich,openmpi", help="comma-separated: mpich, openmpi")
    p.add_argument("--repeat", type=int, default=1, help="interleaved repetitions; medians shown (default 1)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    flavors = [f for f in args.mpi.split(",") if f]
    bed = TwoNodes()
    with signals_unwind():
        try:
            bed.up()
            results = measure(bed, flavors, args.rounds, args.requests, args.repeat)
        except BedUnavailable as e:
            print(f"test bed unavailable: {e}", file=sys.stderr)
            return 77
        finally:
            left = bed.down()
            assert not left, f"the test bed left {left}"
    if args.json:
        print(json.dumps({f"{f} {layout}": v for (f, layout), v in results.items()}))
    else:
        print(render(results, flavors, args.rounds, args.requests))
    return 0


if __name__ == "__main__":
    sys.exit(main())
