"""Onboard or recompute across ranks: every rank measures its own figures (here, each
reports a different prefill rate), yet all ranks take the same decisions, from the
figures MIN-reduced at each end_step. With the disk throttled to 26 ms a block, rank 0
alone (100 tokens/s: 40 ms to recompute a block) would onboard its disk hits and the
others (4,000+ tokens/s) would recompute them: decided per rank, the ranks diverge."""

import pytest

import kvdist
from kvdist.testing import IntegrityDriver
from tests.conftest import make_cfg
from tests.mpi.test_sim import shared_dir

pytestmark = pytest.mark.mpi


def test_ranks_with_different_figures_decide_alike(tmp_path_factory):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    block = 512
    cfg = kvdist.load_config(make_cfg(cache={
        "gpu": {"blocks": 4}, "host": {"bytes": 3 * block},
        "disk": {"path": shared_dir(tmp_path_factory, "policy"), "bytes": 8 * block,
                 "max_read_bytes_per_s": 20_000}}))
    cache = kvdist.create(cfg)
    try:
        d = IntegrityDriver(cache)
        reused = []
        for i in range(16):
            tokens = list(range(100 * (i % 4), 100 * (i % 4) + 12)) + [999]
            d.begin()
            reused.append(d.add(i, tokens))
            d.compute()
            # Only the slowest rank's rate (MIN) may count.
            cache.observe_prefill(100 if world.rank == 0 else 4000 * world.rank, 1.0)
            d.end()
            d.release(i)
        s = cache.stats()["recompute_policy"]
        assert s["prefill_tokens_per_s"] == 100 and s["disk_bytes_per_s"] <= 20_000
        assert s["recomputed_blocks"]["disk"] == 0 and s["onboarded_blocks"]["disk"] > 1
        decisions = (reused, s["onboarded_blocks"], s["recomputed_blocks"])
        assert world.allgather(decisions) == [decisions] * world.size
        cache.check_consistency()  # the caches' states are identical too
        assert d.mismatched_tokens == 0
    finally:
        cache.close()
