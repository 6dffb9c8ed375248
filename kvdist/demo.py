"""A short single-rank demo: churns prompts through every tier with the integrity
driver and prints what the cache did."""

from __future__ import annotations

import argparse
import random

from tabulate import tabulate

from .config import load_config
from .service import create
from .testing import IntegrityDriver


def main(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    n = args.requests or 200
    cache = create(cfg)
    try:
        drv = IntegrityDriver(cache)
        rng = random.Random(cfg.workload.seed)
        tpb = cache.layout.tokens_per_block
        systems = [[rng.randrange(cfg.workload.vocab_size) for _ in range(4 * tpb)] for _ in range(4)]
        history: list[list[int]] = []
        for i in range(n):
            drv.begin()
            if history and rng.random() < 0.5:
                prompt = rng.choice(history) + [rng.randrange(100) for _ in range(rng.randrange(1, tpb))]
            else:
                prompt = rng.choice(systems) + [rng.randrange(100) for _ in range(rng.randrange(1, 3 * tpb))]
            drv.add(i, prompt)
            drv.compute()
            drv.end()
            drv.begin()
            drv.append(i, [rng.randrange(100) for _ in range(tpb)])
            drv.compute()
            drv.end()
            history.append(drv.seqs[i].tokens[:])
            drv.release(i)
        s = cache.stats()
        print(f"kvdist demo: {n} requests on {cache.device}, tiers {', '.join(cache.tiers)}")
        print(tabulate([[t, s["capacity_blocks"][t], s["blocks_used"][t], s["hit_tokens"][t]]
                        for t in cache.tiers], headers=["tier", "blocks", "used", "tokens reused"]))
        print(f"prompt tokens {s['prompt_tokens']}, offloaded {s['bytes_offloaded']} B, "
              f"onboarded {s['bytes_onboarded']} B, demoted {s['bytes_demoted']} B")
        print(f"integrity: {drv.checked_tokens} reused tokens checked, {drv.mismatched_tokens} mismatched")
        return 1 if drv.mismatched_tokens else 0
    finally:
        cache.close()
