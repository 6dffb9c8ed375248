"""``python -m kvdist``: ``run`` (the main job), ``bench`` (the benchmarks) and
``placement`` (where each rank runs and which GPU it picks).

A config mistake prints one line naming the key and exits with status 2."""

from __future__ import annotations

import argparse
import importlib

from . import process
from .errors import ConfigError

BENCHES = ("manager", "scale", "transfer", "staging", "pin", "disk", "consensus", "drills", "remote")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvdist", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="the main job: a serving simulation on the cache")
    run.add_argument("--config", required=True, help="YAML config (see configs/)")
    run.add_argument("--requests", type=int, default=None, help="override workload.requests")
    run.add_argument("--out", default="runs", help="directory for runs/<UTC time>/ results")
    run.add_argument("--metrics-port", type=int, default=None,
                     help="serve Prometheus metrics on this port (rank 0)")
    run.add_argument("--metrics-host", default="127.0.0.1",
                     help="interface the metrics listen on (default 127.0.0.1, this machine only; "
                          "0.0.0.0 opens them to the network)")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    bench = sub.add_parser("bench", help="benchmarks that print figures side by side")
    bench.add_argument("name", choices=BENCHES)
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments of that benchmark")
    place = sub.add_parser("placement", help="print each rank's node, node-local rank and device")
    place.add_argument("--device", default="auto", help="cache.device to resolve (default auto)")
    place.add_argument("--gpus-per-node", type=int, default=None,
                       help="assume nodes with this many GPUs (planning without them)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            from . import sim

            return sim.main(args)
        if args.command == "placement":
            from .sim import placement

            return placement.main(args)
        module = importlib.import_module(f"kvdist.bench.{args.name}")
        return module.main(args.args)
    except ConfigError as e:
        process.say(str(e))  # once: every rank found the same mistake
        return 2


if __name__ == "__main__":
    process.exit_now(main())
