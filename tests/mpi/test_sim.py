"""The main job in miniature on every rank of the MPI job (seconds): reuse from every
tier, zero mismatches, identical results on every rank, results.json on rank 0; the
tensor-parallel model equals one rank holding every head; placement under faked
node layouts."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import kvdist
from kvdist.sim.engine.model import Decoder, Geometry
from kvdist.sim.engine.parallel import TensorParallel
from kvdist.sim.experiment.job import run
from kvdist.sim.experiment.options import RunOptions
from kvdist.sim.experiment.placement import placements
from kvdist.sim.experiment.report import REQUIRED_KEYS
from tests.conftest import make_cfg

pytestmark = pytest.mark.mpi


def shared_dir(tmp_path_factory, name: str) -> str:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    return world.bcast(str(tmp_path_factory.mktemp(name)) if world.rank == 0 else None)


def misreport_reuse_on(rank: int, monkeypatch) -> None:
    """Rule off: on ``rank`` the caches the main job creates report one block more for
    every reused prefix (as a diverged cache would)."""
    from mpi4py import MPI

    real_create = kvdist.sim.experiment.parts.create

    class LyingCache:
        """The cache, but ``rank`` reports 4 more reused tokens than it reused."""

        def __init__(self, cache):
            self.cache = cache

        def __getattr__(self, name):
            return getattr(self.cache, name)

        def add_sequence(self, seq_id, tokens, priority=35):
            n = self.cache.add_sequence(seq_id, tokens, priority)
            return n + 4 if n and MPI.COMM_WORLD.rank == rank else n

    def lying_create(cfg, comm=None):
        return LyingCache(real_create(cfg, comm))

    monkeypatch.setattr(kvdist.sim.experiment.parts, "create", lying_create)


@pytest.mark.parametrize("ahead", [False, True], ids=["serial", "run-ahead"])
def test_short_simulation_reuses_every_tier_with_zero_mismatches(tmp_path_factory, ahead):
    """Under simulated streams; running ahead, every step's table and copies are queued
    while the previous step's forward pass still is."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    base = Path(shared_dir(tmp_path_factory, f"sim-{ahead}"))
    cfg = kvdist.load_config(make_cfg(
        model={"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"},
        cache={"device": "cpu", "gpu": {"blocks": 64}, "host": {"bytes": 24 * 1024},
               "disk": {"path": str(base / "disk"), "bytes": 400 * 1024}, "simulate_async": True,
               "recompute_when_faster": False},  # measured timings would make reuse vary
        distributed={"check_consistency_every": 10},
        workload={"requests": 100, "seed": 5, "system_prompts": 3, "system_prompt_tokens": 40,
                  "conversations": 10, "turns": [2, 5], "user_tokens": [3, 20], "output_tokens": [2, 9],
                  "arrival_rate": 1.5, "max_batch": 6, "max_prefill_tokens": 200, "vocab_size": 97,
                  "hidden": 32, "verify_logits_every": 3, "run_ahead": ahead}))
    r = run(cfg, RunOptions(out=str(base / "runs"), progress=False))
    assert r["ok"], r["integrity"]
    assert r["world_size"] == world.size and r["requests"] == 100
    assert all(r["reused_tokens"][t] > 0 for t in ("gpu", "host", "disk")), r["reused_tokens"]
    assert r["integrity_mismatches"] == 0
    i = r["integrity"]
    assert i["blocks_checked"] == world.size * sum(r["reused_tokens"].values()) // 4
    assert i["logits_checked"] > 3 and i["logits_failed"] == 0
    assert i["consistency"] == {"checks": r["steps"] // 10, "error": None}
    assert r["bytes_offloaded"] > 0 and r["bytes_onboarded"] > 0 and r["bytes_demoted"] > 0
    assert r["bytes_offloaded"] % world.size == 0  # every rank moved the same blocks
    assert world.allgather(json.dumps(r, sort_keys=True)) == [json.dumps(r, sort_keys=True)] * world.size
    if world.rank == 0:
        saved = json.loads((base / "runs" / "latest" / "results.json").read_text(encoding="utf-8"))
        assert all(k in saved for k in REQUIRED_KEYS)
        assert saved["reused_tokens"] == r["reused_tokens"] and saved["world_size"] == world.size
    world.Barrier()
    assert not list((base / "disk").iterdir())  # every rank's disk file is gone


def test_tensor_parallel_model_equals_one_rank_with_every_head():
    from mpi4py import MPI

    tp = TensorParallel()
    solo = TensorParallel(MPI.COMM_SELF)
    try:
        kw = dict(seed=9, device=torch.device("cpu"), kv_dtype=torch.float32, compute_dtype=torch.float32,
                  tokens_per_block=4)
        shape = dict(layers=3, head_dim=8, q_per_kv=2, hidden=24, ffn=40, vocab=50)
        split = Decoder(Geometry(kv_heads=2, **shape), tp=tp, **kw)
        whole = Decoder(Geometry(kv_heads=2 * tp.size, **shape), tp=solo, **kw)
        tokens = np.random.default_rng(1).integers(0, 50, 30).astype(np.int32)
        got = split.forward_dense(tokens)  # collective: one allreduce per layer
        torch.testing.assert_close(got, whole.forward_dense(tokens), rtol=0, atol=1e-5)
        if tp.size > 1:  # each rank really holds only its own heads
            assert split.wqkv[0].shape[1] * tp.size == whole.wqkv[0].shape[1]
    finally:
        solo.free()
        tp.free()


@pytest.mark.parametrize("per_node", [1, 2, 3])
def test_placement_follows_the_node_local_rank(per_node, monkeypatch):
    monkeypatch.setenv("KVDIST_FAKE_RANKS_PER_NODE", str(per_node))
    rank, table = placements("auto", gpus_per_node=2)
    size = len(table)
    assert [p.rank for p in table] == list(range(size)) and table[rank].rank == rank
    for p in table:
        assert (p.node, p.local_rank) == (p.rank // per_node, p.rank % per_node)
        assert p.local_size == min(per_node, size - p.node * per_node)
        assert p.device == f"cuda:{p.local_rank % 2}"
    monkeypatch.setenv("KVDIST_FAKE_RANKS_PER_NODE", "1")
    _, table = placements("cpu")
    assert all(p.device == "cpu" for p in table)


def test_ranks_that_reuse_differently_stop_together(tmp_path_factory, monkeypatch):
    """Rule off: one rank's cache reports a different reuse for one request (as a
    diverged cache would). Every rank must stop at that step and report it."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.size == 1:
        pytest.skip("needs two ranks to diverge")
    base = Path(shared_dir(tmp_path_factory, "diverge"))
    misreport_reuse_on(world.size - 1, monkeypatch)
    cfg = kvdist.load_config(make_cfg(
        model={"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype": "float32"},
        cache={"device": "cpu", "gpu": {"blocks": 64}},
        workload={"requests": 30, "system_prompt_tokens": 12, "conversations": 4, "user_tokens": [2, 6],
                  "output_tokens": [2, 4], "vocab_size": 50, "hidden": 16}))
    r = run(cfg, RunOptions(out=str(base / "runs"), progress=False))
    assert not r["ok"] and r["requests"] < 30
    assert r["integrity"]["consistency"]["error"].startswith(f"step {r['steps']}: ranks reused different")
