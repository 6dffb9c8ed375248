"""The main job, ``python -m kvdist run``: a multi-rank serving simulation on the cache.

Every rank runs the same seeded scheduler over a synthetic chat workload, drives its
cache step by step, computes K/V with a tensor-parallel model that reads them back
through ``block_table``/``kv_pool``, verifies every reused block and a sample of
logits, and rank 0 reports what happened (tables, ``runs/<UTC time>/``, plots).
``--compare`` (the default where the cache is on CUDA) serves the trace in real time
once per configuration and compares the latencies (``compare``)."""

from __future__ import annotations

import argparse
import traceback

from .. import process
from ..config import load_config
from ..distributed import stall
from ..errors import CollectiveMismatch, ConfigError, KVDistError, PeerFailed, RankStalled


def main(args: argparse.Namespace) -> int:
    """Entry point of ``python -m kvdist run`` (on every rank). A mistake in the config
    or the options, or a failed start, is one line from rank 0; Ctrl-C or SIGTERM stops
    every rank at the same step and closes the caches."""
    cfg = load_config(args.config)  # first: a config mistake is reported before torch loads
    if cfg.cache.gpu == "external":
        raise ConfigError("cache.gpu", "external",
                          "the main job runs its own engine: give the GPU tier a size")
    if args.metrics_port is not None and not 1 <= args.metrics_port <= 65535:
        raise ConfigError("--metrics-port", args.metrics_port, "a TCP port is 1..65535")
    if args.rate is not None:
        cfg = cfg.replace(workload={"request_rate": args.rate})
    replicated = bool(cfg.distributed.tp_size)  # replicas compare their own configurations
    given = args.configs
    if given is None:
        given = "" if replicated else "all-tiers,gpu-only,no-reuse"
    configs = tuple(c.strip() for c in given.split(",") if c.strip())
    process.show_warnings_once()
    process.announce_to_launcher()
    process.stop_on_signals()
    from .experiment.job import run
    from .experiment.options import RunOptions
    from .experiment.preflight import StartupFailed, check_run_size

    opts = RunOptions(requests=args.requests, out=args.out, metrics_port=args.metrics_port,
                      metrics_host=args.metrics_host, progress=not args.quiet, compare=args.compare,
                      configs=configs)
    if opts.compare and replicated:  # an option's mistake first
        from .experiment.replica_compare import REPLICA_CONFIGS

        if any(c not in REPLICA_CONFIGS for c in configs):
            raise ConfigError("--configs", given, f"name configurations among {', '.join(REPLICA_CONFIGS)}")
    check_run_size(cfg, args.requests)  # before anything big: distributed.tp_size, the trace and model fit
    if opts.compare is None:
        import torch

        opts.compare = not replicated and cfg.cache.device != "cpu" and torch.cuda.is_available()
    try:
        if opts.compare and replicated:
            from .experiment.replica_compare import run_replica_compare

            results = run_replica_compare(cfg, opts)
        elif opts.compare:
            from .experiment.compare import CONFIGS, run_compare

            if not configs or any(c not in CONFIGS for c in configs):
                raise ConfigError("--configs", args.configs,
                                  f"name configurations among {', '.join(CONFIGS)}")
            results = run_compare(cfg, opts)
        else:
            results = run(cfg, opts)
    except process.Interrupted as e:
        process.say(e.line())
        return e.exit_code
    except RankStalled as e:  # every live rank of the job names the stalled ones
        if process.world_rank() not in e.stalled:  # a stalled rank resumed says nothing
            process.say_here(f"{e.line}; rank {process.world_rank()} closed its cache, the job ends")
        process.leave_without(e.stalled)
        return process.STALLED_EXIT
    except CollectiveMismatch as e:
        process.say_here(f"{e}; rank {process.world_rank()} closed its cache, the job ends")
        return process.STALLED_EXIT
    except KeyboardInterrupt:  # a second Ctrl-C of a job without MPI
        process.say("interrupted; caches closed")
        return 130
    except StartupFailed as e:
        cause = e.cause
        if isinstance(cause, ConfigError):
            raise cause from None
        notes = "; ".join(getattr(cause, "__notes__", ()))
        process.say(f"start-up failed: {cause}" + (f" ({notes})" if notes else ""))
        return 1
    except Exception as e:
        # A rank's set-up failed (parts.abandon) and it told every rank: this one's own
        # error, or the PeerFailed its peer sent (recorded for the process either way).
        told = stall.ended()
        if isinstance(e, ConfigError) or not isinstance(told, PeerFailed):
            raise  # a config error: one line from rank 0 (kvdist.cli); anything else as it is
        if not isinstance(e, KVDistError):  # a bug: its traceback, from its rank
            traceback.print_exception(e)
        process.say(f"{told.line}; every rank closed its cache, the job ends")
        return told.exit_code
    return 0 if results["ok"] else 1


__all__ = ["main"]
