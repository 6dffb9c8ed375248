"""The main job as two replicas (seconds): isolated and sharing side by side on one
trace, sharing reusing what isolated replicas recompute, the one-cache ceiling, zero
mismatches (blocks from the other replica checked against its writes), TP ranks
identical inside each replica, results.json; a TP rank that diverges stops its
replica, and a corrupted block from the other replica is caught: both fail the run."""

import json
from pathlib import Path

import pytest

import kvdist
from kvdist.sim.experiment.job import run
from kvdist.sim.experiment.options import RunOptions
from kvdist.sim.experiment.report import REQUIRED_KEYS
from tests.conftest import make_cfg
from tests.mpi.test_sim import misreport_reuse_on, shared_dir

pytestmark = pytest.mark.mpi


def replicas_cfg(world_size: int, **workload):
    """Two replicas of ``world_size / 2`` ranks; round-robin routing of chats that think
    between turns, so a turn usually lands on the replica that did not serve the last."""
    return kvdist.load_config(make_cfg(
        model={"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype": "float32"},
        cache={"device": "cpu", "gpu": {"blocks": 40}, "host": {"bytes": 256 * 1024}},
        distributed={"tp_size": world_size // 2, "remote": {"enabled": True, "fetch_timeout_ms": 2000},
                     "check_consistency_every": 10},
        workload={"requests": 70, "seed": 2, "system_prompts": 4, "system_prompt_tokens": 16,
                  "conversations": 8, "turns": [3, 6], "user_tokens": [3, 10], "output_tokens": [2, 6],
                  "think_steps": 12, "arrival_rate": 1.0, "max_batch": 6, "max_prefill_tokens": 200,
                  "vocab_size": 97, "hidden": 16, "verify_logits_every": 3,
                  "routing": "round_robin", **workload}))


def prefetch_into_host(monkeypatch) -> None:
    """Prefetches land a node peer's blocks in the host tier, as they do from another
    node, instead of add_sequence fetching them at admission (``RemoteTier.near``): a
    fetch looked up at reservation finds the holder's slots of this tiny, fast-turning
    trace still valid more often than one looked up at admission, so the run reuses
    remote blocks every time. The fetch at admission has its own exact test
    (``tests/mpi/test_remote.py::test_a_node_peers_blocks_are_fetched_at_admission_not_prefetched``)."""
    import kvdist.distributed.remote_setup as setup

    monkeypatch.setattr(setup, "_near", lambda *args: frozenset())


def two_replicas():
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.size < 2 or world.size % 2:
        pytest.skip("two replicas need an even number of ranks")
    return world


def test_sharing_replicas_reuse_what_isolated_ones_recompute(tmp_path_factory, monkeypatch):
    world = two_replicas()
    prefetch_into_host(monkeypatch)
    base = Path(shared_dir(tmp_path_factory, "replicas"))
    r = run(replicas_cfg(world.size), RunOptions(out=str(base / "runs"), progress=False))
    assert r["ok"], (r["integrity"], r["runs"]["sharing"]["replicas"])
    assert (r["replicas"], r["tp_size"], r["world_size"]) == (2, world.size // 2, world.size)
    iso, share = r["runs"]["isolated"], r["runs"]["sharing"]
    computed = r["prefill_tokens_computed"]
    assert computed["no reuse"] == r["prompt_tokens"]
    assert computed["isolated"] == r["prompt_tokens"] - sum(iso["reused_tokens"].values())
    assert r["gap"]["tokens"] == computed["isolated"] - computed["one cache (ceiling)"] > 0
    assert computed["sharing"] < computed["isolated"]
    assert share["reused_tokens"]["remote"] > 0 and "remote" not in iso["reused_tokens"]
    assert share["bytes_fetched_remote"] > 0 and iso["bytes_fetched_remote"] == 0
    assert r["turns"]["sent_away"] > r["turns"]["follow_ups"] // 3
    for name, summary in r["runs"].items():
        assert summary["requests"] == 70, name
        for row in summary["replicas"]:
            assert row["tp_identical"] and row["requests"] == row["requests_routed"] > 0, (name, row)
    i = r["integrity"]
    assert r["integrity_mismatches"] == 0 and i["unknown_blocks"] == 0
    assert i["blocks_checked"] == world.size // 2 * sum(
        sum(run["reused_tokens"].values()) for run in r["runs"].values()) // 4
    assert i["logits_checked"] > 3 and i["logits_failed"] == 0 and i["consistency_error"] is None
    assert world.allgather(json.dumps(r, sort_keys=True)) == [json.dumps(r, sort_keys=True)] * world.size
    if world.rank == 0:
        saved = json.loads((base / "runs" / "latest" / "results.json").read_text(encoding="utf-8"))
        assert all(k in saved for k in REQUIRED_KEYS)
        assert saved["gap"] == r["gap"]
        assert saved["runs"]["sharing"]["replicas"][1] == share["replicas"][1]


def test_replicas_in_time_compare_every_configuration(tmp_path_factory):
    """``run --compare`` of two replicas, small: every configuration serves the whole
    trace in real time, routed at arrival by rank 0's router (round-robin halves it,
    one-cache sends it all to replica 0, prefix-aware follows the replicas' KV events:
    its choices held cached prefixes), TP ranks agree on what arrived (identical
    figures), no mismatched block, the same results on every rank."""
    from kvdist.sim.experiment.replica_compare import REPLICA_CONFIGS, run_replica_compare

    world = two_replicas()
    base = Path(shared_dir(tmp_path_factory, "replicas-time"))
    cfg = replicas_cfg(world.size, requests=40, request_rate=50.0, think_steps=2, step_ms=5)
    r = run_replica_compare(cfg, RunOptions(out=str(base / "runs"), progress=False,
                                            configs=tuple(REPLICA_CONFIGS)))
    assert r["ok"], {n: (run["ok"], run["integrity"]) for n, run in r["runs"].items()}
    assert list(r["runs"]) == list(REPLICA_CONFIGS)
    assert (r["replicas"], r["tp_size"], r["requests_in_trace"]) == (2, world.size // 2, 40)
    runs = r["runs"]
    for name, one in runs.items():
        assert one["latency"]["requests"] == one["requests"] == 40, name
        assert sum(one["routed"]) == 40 and len(one["latency"]["ttft_s"]) == 40, name
        for row in one["replicas"]:
            assert row["tp_identical"] and row["requests"] == row["requests_routed"], (name, row)
    assert runs["isolated"]["routed"] == runs["sharing"]["routed"] == [20, 20]
    assert runs["one-cache"]["routed"] == runs["one-cache-same-batch"]["routed"] == [40, 0]
    ttft = {name: one["latency"]["ttft_ms"]["p50"] for name, one in runs.items()}
    tps = {name: one["latency"]["prompt_tokens_per_s"] for name, one in runs.items()}
    assert {g["what"]: g["ratio"] for g in r["goals"]} == {
        "TTFT p50 sharing / isolated": ttft["sharing"] / ttft["isolated"],
        "TTFT p50 sharing / one-cache": ttft["sharing"] / ttft["one-cache"],
        "TTFT p50 sharing / one-cache-same-batch": ttft["sharing"] / ttft["one-cache-same-batch"],
        "prompt tok/s sharing / isolated": tps["sharing"] / tps["isolated"],
        "TTFT p50 prefix-aware+sharing / isolated": ttft["prefix-aware+sharing"] / ttft["isolated"]}
    assert "overlap_blocks" not in runs["isolated"]["router"]
    assert runs["prefix-aware"]["router"]["overlap_blocks"] > 0  # it saw the replicas' events
    assert runs["prefix-aware+sharing"]["router"]["overlap_blocks"] > 0
    assert "remote" not in runs["isolated"]["reused_tokens"] and runs["isolated"]["bytes_fetched_remote"] == 0
    computed = r["prefill_tokens_computed"]
    assert computed["one-cache"] < computed["isolated"] == r["prompt_tokens"] - sum(
        runs["isolated"]["reused_tokens"].values())
    assert r["gap"]["tokens"] == computed["isolated"] - computed["one-cache"]
    assert r["integrity_mismatches"] == 0 and r["integrity"]["consistency_error"] is None
    assert world.allgather(json.dumps(r, sort_keys=True)) == [json.dumps(r, sort_keys=True)] * world.size
    if world.rank == 0:
        saved = json.loads((base / "runs" / "latest" / "results.json").read_text(encoding="utf-8"))
        assert all(k in saved for k in REQUIRED_KEYS) and saved["gap"] == r["gap"]


def test_a_diverging_tp_rank_stops_its_replica_only(monkeypatch):
    """Rule off: the last rank's cache reports one block more for a reused prefix (a
    diverged TP rank). Its replica stops at that step; the other one serves all of its
    requests; the run fails and says which step."""
    world = two_replicas()
    if world.size < 4:
        pytest.skip("needs TP groups of two ranks to diverge")
    misreport_reuse_on(world.size - 1, monkeypatch)
    r = run(replicas_cfg(world.size, requests=40), RunOptions(out=None, progress=False))
    assert not r["ok"]
    iso = r["runs"]["isolated"]["replicas"]
    assert iso[0]["requests"] == iso[0]["requests_routed"] and iso[0]["consistency"][1] is None
    assert iso[1]["requests"] < iso[1]["requests_routed"]
    assert iso[1]["consistency"][1].startswith(f"step {iso[1]['steps']}: ranks reused different prefixes")


def test_a_corrupted_block_from_the_other_replica_is_caught(monkeypatch):
    """Rule off: on the last TP rank of each replica, the first prompt that reuses blocks
    fetched from the other replica gets one of them overwritten before the model reads
    it. Its digest matches no write of any replica: the run reports it and fails. (Both
    replicas corrupt: in a short wall-clock run one of them may fetch nothing; fetched by
    prefetches, as the sharing test's are, so that a fetch finds the holder's slots still
    valid: looked up at admission, in one run of five on the loaded 2-core box, none did.)"""
    world = two_replicas()
    prefetch_into_host(monkeypatch)
    corrupted, remote_now = [], {}
    tp = world.size // 2
    last_tp_rank = world.rank % tp == tp - 1
    real_create = kvdist.sim.experiment.parts.create

    class CorruptingCache:
        """The cache, but a replica's last TP rank overwrites the V of layer 0 in the last
        reused block (one fetched from the other replica) of its first prompt with remote
        hits."""

        def __init__(self, cache):
            self.cache = cache

        def __getattr__(self, name):
            return getattr(self.cache, name)

        def add_sequence(self, seq_id, tokens, priority=35):
            before = self.cache.stats()["hit_tokens"].get("remote", 0)
            n = self.cache.add_sequence(seq_id, tokens, priority)
            remote_now[seq_id] = (n, self.cache.stats()["hit_tokens"].get("remote", 0) - before)
            return n

        def block_table(self, seq_ids):
            table = self.cache.block_table(seq_ids)
            for row, seq_id in enumerate(seq_ids):
                n, remote = remote_now.get(seq_id, (0, 0))
                if not corrupted and remote and last_tp_rank:
                    last = n // 4 - 1  # remote blocks follow the local ones
                    self.cache.kv_pool(0)[table[row, last], 1] += 1.0
                    corrupted.append((seq_id, last))
            remote_now.clear()
            return table

    def corrupting_create(cfg, comm=None):
        return CorruptingCache(real_create(cfg, comm))

    monkeypatch.setattr(kvdist.sim.experiment.parts, "create", corrupting_create)
    r = run(replicas_cfg(world.size), RunOptions(out=None, progress=False))
    caught = [c for part in world.allgather(corrupted) for c in part]
    assert caught, "no prompt reused a block from the other replica"
    assert not r["ok"] and r["runs"]["isolated"]["ok"]
    i = r["runs"]["sharing"]["integrity"]
    assert i["mismatched_blocks"] >= 1
    assert i["first_mismatch"] in {f"sequence {seq_id!r} block {block} (reused from another replica): bytes "
                                   "differ from every write" for seq_id, block in caught}
