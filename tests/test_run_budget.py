"""The main job's estimate of what it will allocate (``sim.experiment.budget``), checked before
anything is built: the trace's and the model's bytes as the real ones count them,
and the key a too-large run names."""

import math
import threading

import pytest
import torch

import kvdist
from kvdist.sim.engine.model import Decoder, Geometry
from kvdist.sim.engine.parallel import TensorParallel
from kvdist.sim.experiment import preflight
from kvdist.sim.experiment.budget import (
    CHAT_OVERHEAD,
    REQUEST_OVERHEAD,
    Budget,
    check_run,
    model_bytes,
    trace_bytes,
)
from kvdist.sim.experiment.workload import generate

from .conftest import make_cfg

GiB = 1 << 30


def test_trace_bytes_count_the_tokens_the_trace_holds():
    # One chat at a time of exactly 3 turns: request k resends S + (k+1)·U + k·O tokens.
    w = kvdist.load_config(make_cfg(workload={
        "requests": 30, "conversations": 1, "turns": [3, 3], "system_prompts": 2, "system_prompt_tokens": 40,
        "user_tokens": [7, 7], "output_tokens": [5, 5]})).workload
    trace = generate(w)
    tokens = sum(len(r.prompt) + len(r.output) for r in trace.requests)
    assert tokens == 10 * (3 * 40 + 7 * (1 + 2 + 3) + 5 * (0 + 1 + 2) + 3 * 5)
    assert trace_bytes(w, 30) == 30 * REQUEST_OVERHEAD + 4 * tokens + 4 * 40 * 2 + CHAT_OVERHEAD * 1


def _within(seconds: float, fn):
    """``fn()``'s result, or a failure if it has not returned after ``seconds`` (a
    loop that would take hours, not a speed goal)."""
    out: list = []
    worker = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert out, f"{fn} did not return within {seconds} s"
    return out[0]


def test_the_estimate_of_a_huge_range_of_turns_is_a_formula_not_a_loop():
    w = kvdist.load_config(make_cfg(workload={"turns": [1, 10**12], "system_prompt_tokens": 8,
                                              "user_tokens": [2, 2], "output_tokens": [1, 1]})).workload
    n = 10**12
    e_t, e_t2 = (n + 1) / 2, (n + 1) * (2 * n + 1) / 6
    tokens = (e_t * 8 + 2 * (e_t2 + e_t) / 2 + (e_t2 - e_t) / 2) / e_t + 1
    per_request = math.ceil(REQUEST_OVERHEAD + 4 * tokens)
    assert _within(60, lambda: trace_bytes(w, 5)) == 5 * per_request + CHAT_OVERHEAD * 64 + 4 * 8 * 4


def test_a_trace_whose_chats_all_think_jumps_to_the_first_ready_one():
    w = kvdist.load_config(make_cfg(workload={"requests": 3, "conversations": 1, "turns": [3, 3],
                                              "think_steps": 10**12, "output_tokens": [4, 4]})).workload
    trace = _within(60, lambda: generate(w))
    first = trace.requests[0].arrival
    assert [r.arrival for r in trace.requests] == [first, first + 4 + 10**12, first + 2 * (4 + 10**12)]


@pytest.mark.parametrize("ranks", [1, 3])
def test_model_bytes_are_the_weights_a_rank_keeps_and_the_largest_tensor_drawn(ranks):
    cfg = kvdist.load_config(make_cfg(
        model={"num_layers": 3, "num_kv_heads": 2, "head_dim": 8},
        workload={"hidden": 32, "vocab_size": 97, "q_per_kv": 2, "ffn_hidden": 48}))
    g = Geometry.from_config(cfg)
    kept = 97 * 32 + 3 * (32 * (2 + 2) * 16 + 2 * 16 * 32 + 3 * 32 * -(-48 // ranks))
    drawn = max(32 * (2 + 2) * 16 * ranks, 2 * 32 * 48)
    assert model_bytes(cfg, ranks, 4) == 4 * (kept + drawn)
    if ranks == 1:  # the Decoder keeps exactly these weights
        model = Decoder(g, seed=0, tp=TensorParallel(), device=torch.device("cpu"), kv_dtype=torch.float32,
                        compute_dtype=torch.float32, tokens_per_block=4)
        held = [model.embed, *model.wqkv, *model.wo, *model.w13, *model.w2]
        assert sum(t.numel() for t in held) == kept


def _cfg(**sections):
    """conftest's config with a GPU tier that holds the default workload's requests."""
    cache = {"gpu": {"blocks": 1024}, **sections.pop("cache", {})}
    return kvdist.load_config(make_cfg(cache=cache, **sections))


def _check(budget: Budget, **sections):
    return check_run(_cfg(**sections), None, 1, budget)


ONE_GIB = Budget(host=GiB, local_ranks=1)


def test_the_shipped_sizes_fit_and_the_key_that_does_not_is_named():
    assert _check(ONE_GIB) is None
    assert _check(ONE_GIB, workload={"requests": 10**6})[:2] == ("workload.requests", 10**6)
    assert _check(ONE_GIB, workload={"hidden": 8192, "vocab_size": 1 << 20})[:2] == ("workload.hidden", 8192)
    # A GPU tier in bytes of memory: the trace's size names the system prompt.
    big = _check(ONE_GIB, cache={"gpu": {"blocks": None, "memory_fraction": 0.5}},
                 workload={"system_prompt_tokens": 10**7})
    assert big[:2] == ("workload.system_prompt_tokens", 10**7) and "the trace" in big[2]


def test_the_model_on_a_gpu_is_held_against_what_the_gpu_tier_leaves():
    on_gpu = Budget(host=64 * GiB, local_ranks=1, device=GiB, itemsize=2)
    assert _check(on_gpu, workload={"hidden": 1024, "vocab_size": 1 << 17}) is None  # 256 MiB of embedding
    key, value, why = _check(on_gpu, workload={"hidden": 8192, "vocab_size": 1 << 17})
    assert (key, value) == ("workload.hidden", 8192) and "the GPU tier leaves on the device" in why


def test_a_first_turn_longer_than_the_gpu_tier_is_refused_before_the_trace_is_made():
    # A GPU tier of 8 blocks of 4 tokens = 32 tokens; the shortest request 30 + 1 + 1 - 1.
    small = {"gpu": {"blocks": 8}}
    ranges = {"user_tokens": [1, 9], "output_tokens": [1, 4]}
    assert _check(ONE_GIB, cache=small, workload={"system_prompt_tokens": 30, **ranges}) is None
    key, value, why = _check(ONE_GIB, cache=small, workload={"system_prompt_tokens": 32, **ranges})
    assert (key, value) == ("workload.system_prompt_tokens", 32)
    assert why.startswith("the shortest request (33 tokens")
    assert why.endswith("needs 9 GPU blocks, more than the GPU tier's 8")


@pytest.mark.parametrize("dtype", ["int8", "uint8"])
def test_integer_kv_is_the_caches_not_the_runs(dtype):
    cfg = make_cfg(model={"dtype": dtype})
    with kvdist.create(cfg) as cache:  # the cache stores them
        assert cache.layout.dtype == dtype
    assert _check(ONE_GIB, model={"dtype": dtype})[:2] == ("model.dtype", dtype)


def test_check_run_size_raises_on_a_rank_with_too_little_memory(monkeypatch):
    monkeypatch.setattr(preflight, "available_memory", lambda: 10 * REQUEST_OVERHEAD)
    cfg = _cfg(workload={"requests": 50})
    with pytest.raises(kvdist.ConfigError, match="the trace") as ei:
        preflight.check_run_size(cfg, None)
    assert (ei.value.key, ei.value.value) == ("workload.requests", 50)
    with pytest.raises(kvdist.ConfigError) as ei:
        preflight.check_run_size(cfg, 60)  # --requests counts, not the config's
    assert ei.value.value == 60
    monkeypatch.setattr(preflight, "available_memory", lambda: GiB)
    preflight.check_run_size(cfg, None)  # fits: no error
