"""The main job, ``python -m kvdist run``: a multi-rank serving simulation on the cache.

Every rank runs the same seeded scheduler over a synthetic chat workload, drives its
cache step by step, computes K/V with a tiny tensor-parallel model that reads them
back through ``block_table``/``kv_pool``, verifies every reused block and a sample of
logits, and rank 0 reports what happened (tables, ``runs/<UTC time>/``, plots)."""

from __future__ import annotations

import argparse

from ..config import load_config


def main(args: argparse.Namespace) -> int:
    """Entry point of ``python -m kvdist run`` (on every rank)."""
    cfg = load_config(args.config)  # first: a config mistake is reported before torch loads
    from .driver import RunOptions, run

    opts = RunOptions(requests=args.requests, out=args.out, metrics_port=args.metrics_port,
                      progress=not args.quiet)
    results = run(cfg, opts)
    return 0 if results["ok"] else 1


__all__ = ["main"]
