"""``cache.gpu: external`` on CPU: the planner (the engine's scheduler) and a worker rank
over tensors laid out as vLLM lays out its KV. Bytes are checked layer by layer in the
engine's tensors: a block saved out of one engine block and loaded into another holds
exactly the bytes it had, and no other engine block changes."""

from __future__ import annotations

import pytest
import torch

import kvdist
from kvdist.errors import ConfigError, HostTierUnavailable, KVDistError
from kvdist.external import ExternalPlanner, Finished, LoadPlan, SavePlan, TierPlan, create

from .external_kv import BLOCK_BYTES, L, T, block_bytes, config, snapshot, split_kv, vllm_kv

PROMPT = list(range(100, 100 + 5 * T + 1))  # five full blocks and one token


def _check(kv, before, moved: dict[int, int], kv_dim: int = 0) -> None:
    """Engine block ``dst`` holds what block ``src`` held in ``before`` for each
    ``moved[dst] = src``, layer by layer; every other block is unchanged."""
    now = snapshot(kv, kv_dim)
    for layer in range(L):
        for b, got in enumerate(now[layer]):
            want = before[layer][moved.get(b, b)]
            assert torch.equal(got, want), f"layer {layer}, engine block {b}: wrong bytes"


@pytest.fixture
def pair(tmp_path):
    """``make(cfg, kv, **register)`` -> (planner, worker); closes the workers."""
    made = []

    def make(cfg, kv, **register):
        worker = create(cfg)
        made.append(worker)
        worker.register({f"model.layers.{i}.self_attn": t for i, t in enumerate(kv)}, **register)
        return ExternalPlanner(cfg, worker.tier_plan), worker
    yield make
    for w in made:
        w.close()


@pytest.mark.parametrize("order", ["LBNHC", "LBHNC", "BLNHC", "separate"])
def test_a_saved_prompt_loads_into_other_engine_blocks_byte_for_byte(pair, order):
    kv = vllm_kv(16, order)
    planner, worker = pair(config(), kv)
    before = snapshot(kv)
    assert planner.lookup(PROMPT) == 0
    save = planner.plan_save("r1", PROMPT, [3, 7, 1, 12, 5])
    assert save == SavePlan("r1", (3, 7, 1, 12, 5), held=0, dropped=0)
    worker.start(planner.take())
    assert worker.finished().saved == {"r1"}
    # The next request: the engine's GPU holds the first block; kvdist the next four.
    assert planner.lookup(PROMPT, gpu_hit_tokens=T) == 4 * T
    load = planner.plan_load("r2", PROMPT, [9, 0, 14, 2], gpu_hit_tokens=T)
    assert load == LoadPlan("r2", (9, 0, 14, 2), failed=(), tokens=4 * T)
    worker.start(planner.take())
    for layer in range(L):
        worker.wait_layer(layer)
    done = worker.finished()
    assert done.loaded == {"r2"} and done.saved == frozenset()
    assert worker.failed_blocks() == set()
    _check(kv, before, {9: 7, 0: 1, 14: 12, 2: 5})
    planner.check_invariants()
    worker.check_invariants()


@pytest.mark.parametrize("kv_dim,hnd", [(0, False), (0, True), (1, False)],
                         ids=["FA-NHD", "FA-HND", "FlashInfer"])
def test_the_older_split_k_and_v_layouts(pair, kv_dim, hnd):
    kv = split_kv(10, kv_dim, hnd)
    planner, worker = pair(config(), kv, kv_dim=kv_dim)
    before = snapshot(kv, kv_dim)
    planner.plan_save("a", PROMPT, [4, 5, 6])
    worker.start(planner.take())
    planner.plan_load("b", PROMPT, [0, 9, 1])
    worker.start(planner.take())
    _check(kv, before, {0: 4, 9: 5, 1: 6}, kv_dim)


def test_blocks_go_through_host_to_disk_and_come_back_from_disk(pair, tmp_path):
    """A host tier of two blocks over a disk tier: saving five blocks demotes the three
    oldest to disk; loading reads them from disk straight into the engine's blocks."""
    kv = vllm_kv(12)
    planner, worker = pair(config(host_blocks=2, disk_blocks=8, disk_path=str(tmp_path)), kv)
    before = snapshot(kv)
    planner.plan_save("a", PROMPT, [1, 2, 3, 4, 5])
    worker.start(planner.take())
    st = planner.stats()
    assert st["blocks_used"] == {"host": 2, "disk": 3} and st["blocks_moved"]["demote"] == 3
    assert planner.lookup(PROMPT) == 5 * T
    planner.plan_load("b", PROMPT, [6, 7, 8, 9, 10])
    transfers = planner.take()
    assert [r.name for r in transfers.routes()] == ["reload"] * 3 + ["onboard"] * 2
    worker.start(transfers)
    worker.synchronize()
    assert worker.finished().loaded == {"b"}
    _check(kv, before, {6: 1, 7: 2, 8: 3, 9: 4, 10: 5})


def test_a_disk_tier_alone_spills_and_reloads(pair, tmp_path):
    kv = vllm_kv(8)
    planner, worker = pair(config(host_blocks=0, disk_blocks=4, disk_path=str(tmp_path)), kv)
    before = snapshot(kv)
    planner.plan_save("a", PROMPT, [0, 1])
    t = planner.take()
    assert [r.name for r in t.routes()] == ["spill", "spill"]
    worker.start(t)
    planner.plan_load("b", PROMPT, [6, 7])
    worker.start(planner.take())
    worker.synchronize()
    _check(kv, before, {6: 0, 7: 1})


def test_a_block_evicted_between_lookup_and_load_is_reported_failed(pair):
    """lookup promises three blocks; saves of another prompt then evict the last two
    (a host tier of three blocks, no disk); the load fills the first and reports the
    others' engine blocks failed, so the engine computes them again."""
    kv = vllm_kv(12)
    planner, worker = pair(config(host_blocks=3), kv)
    before = snapshot(kv)
    planner.plan_save("a", PROMPT, [0, 1, 2])
    worker.start(planner.take())
    assert planner.lookup(PROMPT) == 3 * T
    other = [7] * (3 * T)
    planner.plan_save("b", other, [3, 4])  # evicts the two least recently used blocks
    load = planner.plan_load("c", PROMPT, [8, 9, 10])
    assert load == LoadPlan("c", (8,), failed=(9, 10), tokens=T)
    worker.start(planner.take())
    assert worker.failed_blocks() == {9, 10}
    assert worker.failed_blocks() == set()  # drained
    assert worker.finished().loaded == {"c"}
    _check(kv, before, {8: 0})


def test_a_load_whose_every_block_failed_is_still_reported_finished(pair):
    kv = vllm_kv(8)
    planner, worker = pair(config(host_blocks=1), kv)
    planner.plan_save("a", PROMPT, [0])
    worker.start(planner.take())
    assert planner.lookup(PROMPT) == T
    planner.plan_save("b", [3] * (T + 1), [1])  # takes the only slot
    assert planner.plan_load("c", PROMPT, [6]) == LoadPlan("c", (), failed=(6,), tokens=0)
    worker.start(planner.take())
    assert worker.finished() == Finished(saved=frozenset({"a", "b"}), loaded=frozenset({"c"}))
    assert worker.failed_blocks() == {6}


def test_the_external_load_drill_fails_every_load_of_the_rank(pair, monkeypatch):
    kv = vllm_kv(8)
    planner, worker = pair(config(), kv)
    before = snapshot(kv)
    planner.plan_save("a", PROMPT, [0, 1])
    worker.start(planner.take())
    monkeypatch.setenv("KVDIST_FAULTS", "external_load@0")
    planner.plan_load("b", PROMPT, [5, 6])
    worker.start(planner.take())
    assert worker.failed_blocks() == {5, 6}
    assert worker.finished().loaded == {"b"}
    _check(kv, before, {})  # nothing written


def test_lookup_counts_only_blocks_beyond_the_gpu_hit_and_never_the_whole_prompt(pair):
    kv = vllm_kv(8)
    planner, worker = pair(config(), kv)
    exact = PROMPT[: 3 * T]  # three full blocks, no token after them
    planner.plan_save("a", exact, [0, 1, 2])
    assert planner.lookup(exact) == 2 * T  # the last block is computed
    assert planner.lookup(exact + [5]) == 3 * T
    assert planner.lookup(exact + [5], gpu_hit_tokens=2 * T) == T
    assert planner.lookup(exact + [5], gpu_hit_tokens=3 * T) == 0
    assert planner.lookup([9] + exact[1:] + [5]) == 0  # the chain starts elsewhere
    assert planner.saveable(exact) == 0 and planner.saveable(PROMPT) == 2


def test_saving_what_kvdist_holds_copies_nothing(pair):
    kv = vllm_kv(8)
    planner, worker = pair(config(), kv)
    planner.plan_save("a", PROMPT, [0, 1])
    assert len(planner.take()) == 2
    assert planner.plan_save("b", PROMPT, [4, 5, 6], first_block=0) == SavePlan("b", (6,), held=2, dropped=0)
    assert [(r.name, s, d) for r, s, d in zip(planner.take().routes(), [6], [2])] == [("offload", 6, 2)]


def test_engine_block_keys_keep_prompts_apart_that_tokens_would_not(pair):
    """The engine's own block keys (vLLM's hashes cover LoRA adapters and multimodal
    inputs): the same tokens under other keys are another prompt."""
    kv = vllm_kv(8)
    planner, worker = pair(config(), kv)
    keys = [b"lora-1/%d" % i for i in range(5)]
    p = planner.prompt_of_keys(keys, len(PROMPT))
    planner.plan_save("a", p, [0, 1, 2, 3, 4])
    assert planner.lookup(p) == 5 * T
    assert planner.lookup(PROMPT) == 0
    assert planner.lookup(planner.prompt_of_keys([b"lora-2/%d" % i for i in range(5)], len(PROMPT))) == 0


def test_the_recompute_policy_cuts_what_is_slower_to_load_than_to_compute(pair, tmp_path):
    """Figures from the workers (disk slower to read than the engine computes): the
    disk blocks of a prefix are not offered, the host ones are."""
    kv = vllm_kv(12)
    planner, worker = pair(config(host_blocks=3, disk_blocks=8, disk_path=str(tmp_path)), kv)
    prompt = PROMPT[: 3 * T + 1]
    planner.plan_save("a", prompt, [1, 2, 3])  # all three in host, the tail coldest
    planner.plan_save("b", [5] * (2 * T), [6, 7])  # evicts the tail's two blocks to disk
    assert planner.stats()["blocks_used"] == {"host": 3, "disk": 2}
    assert planner.lookup(prompt) == 3 * T  # no figures yet: everything is loaded (and measured)
    planner.agree([10 ** 12, 1, 1000])  # bytes/s host and disk, prompt tokens/s
    assert planner.lookup(prompt) == T
    planner.agree([10 ** 12, 10 ** 12, 1000])
    assert planner.lookup(prompt) == 3 * T
    planner.agree([1, 1, 1000])  # the host tier slower than computing too: nothing
    assert planner.lookup(prompt) == 0


def test_mistakes_are_one_line_errors_naming_the_key(pair, tmp_path):
    with pytest.raises(ConfigError, match=r"cache.host.bytes.*external give a size"):
        kvdist.load_config({**config(), "cache": {**config()["cache"], "host": {"bytes": "auto"}}})
    with pytest.raises(ConfigError, match=r"'cache.gpu'.*needs a host or disk tier"):
        kvdist.load_config({**config(), "cache": {**config()["cache"], "host": {"bytes": 0}}})
    with pytest.raises(ConfigError, match=r"'cache.gpu'.*or external \(got 'externl'\)"):
        kvdist.load_config({**config(), "cache": {**config()["cache"], "gpu": "externl"}})
    with pytest.raises(ConfigError, match=r"distributed.remote.enabled.*needs a host tier"):
        kvdist.load_config({**config(), "cache": {**config()["cache"], "host": {"bytes": 0},
                                                  "disk": {"path": str(tmp_path), "bytes": "1MiB"}},
                            "distributed": {"remote": {"enabled": True}}})
    with pytest.raises(ConfigError, match=r"cache.events.enabled.*no KV cache events"):
        kvdist.load_config({**config(), "cache": {**config()["cache"], "events": {"enabled": True}}})
    with pytest.raises(ConfigError, match=r"kvdist.external.create"):
        kvdist.create(config())
    worker = create(config())
    try:
        bad = vllm_kv(8)
        with pytest.raises(ConfigError, match=r"kv_caches\[l2\].*\(8, 2, 4, 7\)"):
            worker.register({"l0": bad[0], "l1": bad[1], "l2": bad[2][..., :7]})
        with pytest.raises(ConfigError, match=r"kv_caches\[l1\].*'float32'"):
            worker.register({"l0": bad[0], "l1": bad[1].float(), "l2": bad[2]})
        with pytest.raises(ConfigError, match=r"model.num_layers.*registered 2 KV tensors"):
            worker.register(bad[:2])
        strided = torch.zeros(8, 2, 2 * T, 8, dtype=torch.float16)[:, :, ::2]
        with pytest.raises(ConfigError, match=r"kv_caches\[l0\].*not dense"):
            worker.register({"l0": strided, "l1": bad[1], "l2": bad[2]})
        with pytest.raises(KVDistError, match="register the engine's KV tensors first"):
            worker.wait_layer(0)
    finally:
        worker.close()


def test_a_planner_numbering_more_slots_than_the_worker_committed_is_refused(pair):
    """A planner numbering tiers beyond the worker's is refused; one using fewer slots
    (the MIN over workers that committed different tiers) leaves the rest unused."""
    kv = vllm_kv(8)
    _, worker = pair(config(), kv)
    other = ExternalPlanner(config(), TierPlan(host_blocks=16, disk_blocks=0))
    other.plan_save("a", PROMPT, [0])
    with pytest.raises(KVDistError, match=r"TierPlan\(host_blocks=16.*committed TierPlan\(host_blocks=8"):
        worker.start(other.take())
    assert worker.tier_plan == TierPlan(8, 0) and worker.tiers == ("host",)
    fewer = ExternalPlanner(config(), TierPlan(host_blocks=4, disk_blocks=0))
    fewer.plan_save("a", PROMPT, [0])
    worker.start(fewer.take())
    assert worker.stats()["blocks_moved"] == {"offload": 1}
    assert BLOCK_BYTES == kvdist.load_config(config()).model.num_layers * 2 * T * 2 * 4 * 2
    assert block_bytes(kv, 0, 0).numel() == BLOCK_BYTES // L


def test_the_workers_figures_feed_the_planners_cut(pair, tmp_path):
    """A worker's measured load bandwidth and the engine's prefill rate, agreed by the
    planner: a prefill far faster than any copy makes loading pointless."""
    kv = vllm_kv(8)
    planner, worker = pair(config(), kv)
    planner.plan_save("a", PROMPT, [0, 1])
    worker.start(planner.take())
    planner.plan_load("b", PROMPT, [4, 5])
    worker.start(planner.take())
    worker.synchronize()
    worker.observe_prefill(10 ** 12, 1.0)  # a trillion tokens a second
    figures = worker.figures()
    assert figures[0] > 0 and figures[2] == 10 ** 12  # host bytes/s measured; prefill as observed
    assert planner.lookup(PROMPT) == 2 * T
    planner.agree(figures)
    assert planner.lookup(PROMPT) == 0
    assert worker.stats()["blocks_moved"] == {"offload": 2, "onboard": 2}


def test_the_planner_adopts_the_tiers_the_workers_committed(tmp_path):
    """After USE_NO_HOST the workers have no host tier: the planner, told so before it
    plans (vLLM's handshake), saves to disk; with no tier left it refuses, one line."""
    cfg = config(host_blocks=8, disk_blocks=4, disk_path=str(tmp_path))
    planner = ExternalPlanner(cfg)
    assert planner.tiers == TierPlan(8, 4)
    planner.adopt(TierPlan(0, 4))
    assert planner.tiers == TierPlan(0, 4)
    planner.plan_save("a", PROMPT, [3, 7])
    t = planner.take()
    assert [r.name for r in t.routes()] == ["spill", "spill"] and t.dst.tolist() == [0, 1]
    assert planner.stats()["blocks_used"] == {"disk": 2}
    with pytest.raises(HostTierUnavailable, match=r"no disk tier is configured \(cache.disk\)"):
        ExternalPlanner(config()).adopt(TierPlan(0, 0))
