"""``python -m kvdist``: ``run`` (the main job), ``bench`` (the benchmarks) and
``placement`` (where each rank runs and which GPU it picks).

A config mistake prints one line naming the key and exits with status 2."""

from __future__ import annotations

import argparse
import importlib

from . import process
from .errors import ConfigError

DESCRIPTION = """\
kvdist, a multi-rank tiered KV cache: run the main job (a serving simulation), the
benchmarks, or show where each rank runs. Start several ranks with
launch/kvdist-launch -n 4 run (or under mpiexec); one process runs alone. A config
or option mistake prints one line naming it and exits with status 2."""

BENCHES = ("manager", "scale", "transfer", "layerwise", "staging", "pin", "goals", "disk", "consensus",
           "drills", "remote", "events")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvdist", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="the main job: a serving simulation on the cache")
    run.add_argument("--config", default="default",
                     help="a YAML file, or the name of a shipped config: "
                          f"{', '.join(shipped_configs())} (default: default)")
    run.add_argument("--requests", type=int, default=None, help="override workload.requests")
    run.add_argument("--out", default="runs", help="directory for runs/<UTC time>/ results")
    run.add_argument("--metrics-port", type=int, default=None,
                     help="serve Prometheus metrics on this port (rank 0)")
    run.add_argument("--metrics-host", default="127.0.0.1",
                     help="interface the metrics listen on (default 127.0.0.1, this machine only; "
                          "0.0.0.0 opens them to the network)")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument("--compare", action=argparse.BooleanOptionalAction, default=None,
                     help="serve the trace in real time once with all tiers, once with the GPU tier only "
                          "and once without reuse, and compare latencies (default: on when the cache is "
                          "on CUDA)")
    run.add_argument("--rate", type=float, default=None,
                     help="override workload.request_rate (requests/s of a --compare run)")
    run.add_argument("--configs", default=None,
                     help="configurations compared, comma-separated, among all-tiers, all-tiers-serial, "
                          "gpu+host, gpu-only, no-reuse (default: all-tiers,gpu-only,no-reuse; "
                          "all-tiers-serial joins all-tiers where that runs ahead); for a job of replicas "
                          "among isolated, sharing, prefix-aware, prefix-aware+sharing, one-cache, "
                          "one-cache-same-batch (default: all but the last)")
    bench = sub.add_parser("bench", help="benchmarks that print figures side by side")
    bench.add_argument("name", choices=BENCHES)
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments of that benchmark")
    place = sub.add_parser("placement", help="print each rank's node, node-local rank and device")
    place.add_argument("--device", default="auto", help="cache.device to resolve (default auto)")
    place.add_argument("--gpus-per-node", type=int, default=None,
                       help="assume nodes with this many GPUs (planning without them)")
    return p


def shipped_configs() -> list[str]:
    """Names of the configs that come with the package (``configs/`` of the repository)."""
    from importlib import resources

    found = resources.files("kvdist").joinpath("configs").iterdir()
    return sorted(p.name.removesuffix(".yaml") for p in found if p.name.endswith(".yaml"))


def config_path(given: str) -> str:
    """``given`` if it is a file, else the shipped config of that name; ConfigError if
    neither exists."""
    import os
    from importlib import resources

    if os.path.exists(given) or os.sep in given or given.endswith((".yaml", ".yml")):
        return given
    shipped = resources.files("kvdist").joinpath("configs", f"{given}.yaml")
    if not shipped.is_file():
        raise ConfigError("--config", given,
                          f"no such file, nor a shipped config ({', '.join(shipped_configs())})")
    return str(shipped)


def main(argv: list[str] | None = None) -> int:
    process.printable_anywhere()
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            from . import sim

            args.config = config_path(args.config)
            return sim.main(args)
        if args.command == "placement":
            from .sim.experiment import placement

            if args.gpus_per_node is not None and args.gpus_per_node < 1:
                raise ConfigError("--gpus-per-node", args.gpus_per_node, "must be at least 1")
            return placement.main(args)
        module = importlib.import_module(f"kvdist.bench.{args.name}")
        return module.main(args.args)
    except ConfigError as e:
        process.say(str(e))  # once: every rank found the same mistake
        return 2


if __name__ == "__main__":
    process.exit_now(main())
