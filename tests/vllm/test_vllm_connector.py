"""KVDistConnector in vLLM 0.33.0's real Scheduler, with a worker-side connector over
CPU KV tensors allocated as vLLM allocates them (tests/vllm/harness.py): every
scheduler-side and worker-side call of the connector API, with exact block ids, token
counts and bytes.

A prompt of 3 full blocks and 5 tokens runs as request ``a`` (one output token); its
blocks are saved to kvdist behind the forward that computes them (``harness.save_a``;
the saves themselves: ``test_vllm_saves.py``). vLLM's own prefix cache is then reset, so
request ``b`` (the same 3 blocks, another tail) misses vLLM's GPU cache and hits
kvdist's."""

from __future__ import annotations

import errno
import os

import pytest

vllm = pytest.importorskip("vllm", reason=os.environ.get("KVDIST_VLLM_SKIP", "needs vLLM (make vllm)"))

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvdist.errors import CacheClosedError, ConfigError  # noqa: E402
from kvdist.external import Job  # noqa: E402
from kvdist.integrations.vllm import KVDistConnector, local_worker  # noqa: E402
from kvdist.storage import DiskPool  # noqa: E402
from kvdist.transfer import OFFLOAD, ONBOARD, RELOAD  # noqa: E402

from .harness import (  # noqa: E402
    BLOCK,
    LAYERS,
    NUM_BLOCKS,
    PROMPT,
    TAIL,
    Engine,
    expected,
    kv_cache_config,
    request,
    rows,
    save_a,
    vllm_config,
)


def test_vllm_0_33_0_abstract_methods_are_the_ones_kvdist_implements():
    assert vllm.__version__ == "0.33.0"
    abstract = sorted(KVConnectorBase_V1.__abstractmethods__)
    assert abstract == ["build_connector_meta", "get_num_new_matched_tokens", "save_kv_layer",
                        "start_load_kv", "update_state_after_alloc", "wait_for_layer_load", "wait_for_save"]
    overridden = {"register_kv_caches", "get_finished", "get_block_ids_with_load_errors", "shutdown",
                  "request_finished", "update_connector_output", "get_required_kvcache_layout", *abstract}
    assert overridden <= set(vars(KVDistConnector))
    for name in overridden:
        assert hasattr(KVConnectorBase_V1, name), f"vLLM's connector API has no {name} any more"
    assert not KVDistConnector.__abstractmethods__


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_prompt_saved_by_one_request_is_loaded_into_the_next_ones_blocks(engine, tier):
    e = engine(tier)
    save_a(e)
    b = e.add(request("b", PROMPT[:3 * BLOCK] + TAIL))
    s3 = e.step()
    # vLLM computes only the tail: kvdist supplied the 48 tokens of the 3 blocks
    assert s3.out.num_scheduled_tokens == {"b": len(TAIL)}
    b_blocks = list(s3.out.scheduled_new_reqs[0].block_ids[0])
    assert s3.out.scheduled_new_reqs[0].num_computed_tokens == 3 * BLOCK
    route = ONBOARD.name if tier == "host" else RELOAD.name
    assert rows(s3) == [(route, [0, 1, 2], b_blocks[:3])]
    assert s3.out.kv_connector_metadata.transfers.jobs == (Job("b", "load", tuple(b_blocks[:3])),)
    assert s3.kv.invalid_block_ids == set() and not s3.kv.finished_recving
    for layer in range(len(LAYERS)):  # what attention read once the layer's load was waited for
        assert s3.heads("read", "b", layer)[:3].equal(expected(layer, b.all_token_ids, 0, 3))
    assert e.connector.planner.stats()["hit_tokens"] == {tier: 3 * BLOCK}


def test_kvdist_supplies_the_blocks_after_vllms_own_gpu_hit(engine):
    e = engine()
    save_a(e)
    # c shares a's first block only: loaded from kvdist, then cached by vLLM's GPU cache
    e.add(request("c", PROMPT[:BLOCK] + TAIL))
    s3 = e.step()
    assert s3.out.num_scheduled_tokens == {"c": len(TAIL)}
    c_blocks = list(s3.out.scheduled_new_reqs[0].block_ids[0])
    assert rows(s3) == [(ONBOARD.name, [0], c_blocks[:1])]
    e.step()  # c's block was held already: nothing to save
    b = e.add(request("b", PROMPT[:3 * BLOCK] + TAIL))
    s5 = e.step()
    new = s5.out.scheduled_new_reqs[0]
    assert new.block_ids[0][0] == c_blocks[0]  # vLLM's own hit: block 0
    assert new.num_computed_tokens == 3 * BLOCK and s5.out.num_scheduled_tokens == {"b": len(TAIL)}
    assert rows(s5) == [(ONBOARD.name, [1, 2], list(new.block_ids[0][1:3]))]
    for layer in range(len(LAYERS)):
        assert s5.heads("read", "b", layer)[:3].equal(expected(layer, b.all_token_ids, 0, 3))


def test_an_asynchronous_load_makes_the_request_wait_one_step(engine):
    e = engine(load_async=True)
    save_a(e)
    b = e.add(request("b", PROMPT[:3 * BLOCK] + TAIL))
    s3 = e.step()
    assert s3.out.num_scheduled_tokens == {}  # b waits for its blocks
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    b_blocks = e.blocks("b")
    meta = s3.out.kv_connector_metadata
    assert meta.async_loads == {"b"} and rows(s3) == [(ONBOARD.name, [0, 1, 2], b_blocks[:3])]
    assert s3.kv.finished_recving == {"b"}
    s4 = e.step()
    assert s4.out.num_scheduled_tokens == {"b": len(TAIL)}
    assert s4.out.scheduled_new_reqs[0].num_computed_tokens == 3 * BLOCK
    assert list(s4.out.scheduled_new_reqs[0].block_ids[0][:3]) == b_blocks[:3]
    for layer in range(len(LAYERS)):
        assert s4.heads("read", "b", layer)[:3].equal(expected(layer, b.all_token_ids, 0, 3))


def test_a_failed_load_makes_vllm_recompute_the_blocks(engine, monkeypatch):
    e = engine()
    save_a(e)
    monkeypatch.setenv("KVDIST_FAULTS", "external_load@0")  # this worker's loads fail
    b = e.add(request("b", PROMPT[:3 * BLOCK] + TAIL))
    s3 = e.step()
    b_blocks = list(s3.out.scheduled_new_reqs[0].block_ids[0])
    assert s3.out.num_scheduled_tokens == {"b": len(TAIL)}
    assert s3.kv.invalid_block_ids == set(b_blocks[:3])
    monkeypatch.delenv("KVDIST_FAULTS")
    s4 = e.step()  # vLLM recomputes from the first failed block on
    assert s4.out.num_scheduled_tokens == {"b": len(b.all_token_ids) - 1}
    assert rows(s4) == []
    for layer in range(len(LAYERS)):
        assert e.layer_blocks(layer, b_blocks[:3]).equal(expected(layer, b.all_token_ids, 0, 3))


def test_a_failed_disk_read_leaves_the_blocks_and_vllm_recomputes_them(engine, monkeypatch):
    """An I/O error reading kvdist's disk tier: the engine blocks of that read are left as
    they were and named by get_block_ids_with_load_errors; vLLM recomputes them."""
    e = engine("disk")
    save_a(e)

    def broken(self, slots, buffers):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(DiskPool, "read_blocks", broken)
    b = e.add(request("b", PROMPT[:3 * BLOCK] + TAIL))
    s3 = e.step()
    b_blocks = list(s3.out.scheduled_new_reqs[0].block_ids[0])
    assert s3.out.num_scheduled_tokens == {"b": len(TAIL)}
    assert rows(s3) == [(RELOAD.name, [0, 1, 2], b_blocks[:3])]
    assert s3.kv.invalid_block_ids == set(b_blocks[:3])
    for layer in range(len(LAYERS)):  # the failed read wrote nothing
        assert s3.heads("read", "b", layer)[:3].equal(s3.heads("before", "b", layer)[:3])
    monkeypatch.undo()
    s4 = e.step()  # vLLM recomputes from the first failed block on
    assert s4.out.num_scheduled_tokens == {"b": len(b.all_token_ids) - 1} and rows(s4) == []
    for layer in range(len(LAYERS)):
        assert e.layer_blocks(layer, b_blocks[:3]).equal(expected(layer, b.all_token_ids, 0, 3))


def test_a_failed_asynchronous_load_ends_the_wait_and_vllm_asks_again(engine, monkeypatch):
    e = engine(load_async=True)
    save_a(e)
    monkeypatch.setenv("KVDIST_FAULTS", "external_load@0")
    b = e.add(request("b", PROMPT[:3 * BLOCK] + TAIL))
    s3 = e.step()
    b_blocks = e.blocks("b")
    assert s3.out.num_scheduled_tokens == {} and b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert s3.kv.finished_recving == {"b"} and s3.kv.invalid_block_ids == set(b_blocks[:3])
    monkeypatch.delenv("KVDIST_FAULTS")
    s4 = e.step()  # back to waiting with nothing computed: vLLM asks kvdist again, which loads now
    b_blocks = e.blocks("b")
    assert s4.out.num_scheduled_tokens == {} and rows(s4) == [(ONBOARD.name, [0, 1, 2], b_blocks[:3])]
    assert s4.kv.finished_recving == {"b"} and s4.kv.invalid_block_ids == set()
    s5 = e.step()
    assert s5.out.num_scheduled_tokens == {"b": len(TAIL)}
    for layer in range(len(LAYERS)):
        assert s5.heads("read", "b", layer)[:3].equal(expected(layer, b.all_token_ids, 0, 3))
    for layer in range(len(LAYERS)):
        assert e.layer_blocks(layer, b_blocks[:3]).equal(expected(layer, b.all_token_ids, 0, 3))


def test_a_cache_salt_keeps_tenants_apart(engine):
    """kvdist names blocks by vLLM's block hashes: the same tokens under another cache
    salt (or LoRA adapter, or multimodal input) are other blocks."""
    e = engine()
    e.add(request("s", PROMPT, cache_salt="tenant-1"))
    s = e.step()
    s_blocks = list(s.out.scheduled_new_reqs[0].block_ids[0])
    assert rows(s, "saves") == [(OFFLOAD.name, s_blocks[:3], [0, 1, 2])]
    assert e.step().kv.finished_sending == {"s"}
    assert e.scheduler.reset_prefix_cache()
    e.add(request("u", PROMPT[:3 * BLOCK] + TAIL))  # no salt: kvdist holds none of its blocks
    s = e.step()
    assert s.out.num_scheduled_tokens == {"u": 3 * BLOCK + len(TAIL)} and rows(s) == []
    assert rows(s, "saves") == [(OFFLOAD.name, list(s.out.scheduled_new_reqs[0].block_ids[0][:3]), [3, 4, 5])]
    e.step()  # u's blocks saved under its own keys; vLLM frees them
    assert e.scheduler.reset_prefix_cache()
    t = e.add(request("t", PROMPT[:3 * BLOCK] + TAIL, cache_salt="tenant-1"))
    s = e.step()
    assert s.out.num_scheduled_tokens == {"t": len(TAIL)}
    assert rows(s) == [(ONBOARD.name, [0, 1, 2], list(s.out.scheduled_new_reqs[0].block_ids[0][:3]))]
    for layer in range(len(LAYERS)):
        assert s.heads("read", "t", layer)[:3].equal(expected(layer, t.all_token_ids, 0, 3))


def test_each_layer_is_loaded_by_the_time_its_wait_returns(engine):
    e = engine(simulate_async="true", layer_groups=len(LAYERS))
    e.add(request("a", PROMPT))
    e.step()
    e.step()  # a's save issued
    e.worker.kvdist.synchronize()
    assert e.step().kv.finished_sending == {"a"}
    assert e.scheduler.reset_prefix_cache()
    b = e.add(request("b", PROMPT[:3 * BLOCK] + TAIL))
    s = e.step()
    for layer in range(len(LAYERS)):
        want = expected(layer, b.all_token_ids, 0, 3)
        assert not s.heads("before", "b", layer)[:3].equal(want), f"layer {layer} was loaded before its wait"
        assert s.heads("read", "b", layer)[:3].equal(want)


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.BLNHC])
def test_other_vllm_layouts_load_the_same_bytes(engine, layout):
    e = engine(layout=layout)
    save_a(e)
    b = e.add(request("b", PROMPT[:3 * BLOCK] + TAIL))
    s = e.step()
    assert s.out.num_scheduled_tokens == {"b": len(TAIL)}
    for layer in range(len(LAYERS)):
        assert s.heads("read", "b", layer)[:3].equal(expected(layer, b.all_token_ids, 0, 3))


def test_tp_workers_load_their_own_heads_and_a_save_holds_until_every_worker_finished(engine):
    """Two TP workers, each a kvdist rank with one of the two KV heads, joined by vLLM's
    KVOutputAggregator: one planner's copies run on both, and vLLM frees a saved
    request's blocks only once both workers finished its save."""
    e = engine(tp=2, simulate_async="true")
    e.add(request("a", PROMPT))
    s1 = e.step()
    a_blocks = list(s1.out.scheduled_new_reqs[0].block_ids[0])
    assert rows(s1, "saves") == [(OFFLOAD.name, a_blocks[:3], [0, 1, 2])]
    s2 = e.step()
    assert not s2.kv.finished_sending
    e.workers[0].kvdist.synchronize()  # worker 0's copy of its heads runs; worker 1's does not
    s3 = e.step()
    assert [w.finished_sending for w in s3.per_worker] == [{"a"}, set()] and not s3.kv.finished_sending
    pool = e.scheduler.kv_cache_manager.block_pool
    assert [pool.blocks[i].ref_cnt for i in a_blocks] == [1, 1, 1, 1]
    e.workers[1].kvdist.synchronize()
    s4 = e.step()
    assert s4.kv.finished_sending == {"a"} and [pool.blocks[i].ref_cnt for i in a_blocks] == [0, 0, 0, 0]
    assert e.scheduler.reset_prefix_cache()
    b = e.add(request("b", PROMPT[:3 * BLOCK] + TAIL))
    s5 = e.step()
    b_blocks = list(s5.out.scheduled_new_reqs[0].block_ids[0])
    assert s5.out.num_scheduled_tokens == {"b": len(TAIL)}
    assert rows(s5) == [(ONBOARD.name, [0, 1, 2], b_blocks[:3])]
    for layer in range(len(LAYERS)):
        assert s5.heads("read", "b", layer)[:3].equal(expected(layer, b.all_token_ids, 0, 3))


def test_a_disk_slower_than_recomputing_is_not_read_again(engine):
    """The workers report their figures (load bandwidth by tier, the forward's time per
    token) in vLLM's worker metadata; the planner adopts their MIN, and its lookup stops
    offering disk hits once reading them costs more than computing the tokens."""
    e = engine("disk", recompute_when_faster="true", disk_max_read_bytes_per_s="32KiB")
    save_a(e)
    policy = lambda: e.connector.planner.stats()["recompute_policy"]  # noqa: E731
    assert policy()["disk_bytes_per_s"] is None  # no figure yet: the hit is loaded, and timed
    e.add(request("b", PROMPT[:3 * BLOCK] + TAIL))
    s = e.step()
    assert s.out.num_scheduled_tokens == {"b": len(TAIL)} and rows(s)[0][0] == RELOAD.name
    assert policy()["disk_bytes_per_s"] <= 32 * 1024 and policy()["prefill_tokens_per_s"] is not None
    assert e.scheduler.reset_prefix_cache()
    c = e.add(request("c", PROMPT[:3 * BLOCK] + TAIL[::-1]))
    s = e.step()
    assert s.out.num_scheduled_tokens == {"c": c.num_prompt_tokens} and rows(s) == []


def test_shutdown_finishes_the_copies_and_frees_kvdist(engine):
    e = engine(simulate_async="true")
    e.add(request("a", PROMPT))
    e.step()
    s2 = e.step()
    assert not s2.kv.finished_sending
    cache = e.worker.kvdist
    executor = cache.executor
    assert executor.queued() == 1  # the save, not run yet
    e.close()  # vLLM's ensure_kv_transfer_shutdown -> shutdown
    assert executor.queued() == 0
    with pytest.raises(CacheClosedError):
        cache.finished()


def test_config_mistakes_name_the_key(model, tmp_path):
    (tmp_path / "k.yaml").write_text("model: {num_layers: 7}\ncache: {host: {bytes: 64KiB}}\n",
        encoding="utf-8")
    with pytest.raises(ConfigError, match=r"'model.num_layers': vLLM runs with 2: leave it out \(got 7\)"):
        Engine(vllm_config(model, tmp_path / "k.yaml", NUM_BLOCKS), NUM_BLOCKS)
    with pytest.raises(ConfigError, match=r"'kv_connector_extra_config.load_async': must be true or false"):
        Engine(vllm_config(model, tmp_path / "k.yaml", NUM_BLOCKS, load_async="yes"), NUM_BLOCKS)
    with pytest.raises(ConfigError, match=r"'kv_connector_extra_config.kvdist_cfg': unknown key"):
        Engine(vllm_config(model, tmp_path / "k.yaml", NUM_BLOCKS, kvdist_cfg="x"), NUM_BLOCKS)
    # The remote tier needs the worker beside the scheduler (external_launcher); a
    # scheduler of its own process (vLLM's multiprocessing executor) refuses it.
    (tmp_path / "r.yaml").write_text(
        "cache: {host: {bytes: 64KiB}}\ndistributed: {remote: {enabled: true}}\n", encoding="utf-8")
    assert local_worker.take() == (False, None)  # every engine before shut its worker down
    alone = KVDistConnector(vllm_config(model, tmp_path / "r.yaml", NUM_BLOCKS), KVConnectorRole.SCHEDULER,
                            kv_cache_config(NUM_BLOCKS, KVCacheLayout.LBNHC))
    with pytest.raises(ConfigError, match=r"'distributed.remote.enabled': needs each TP worker's process"):
        alone.set_xfer_handshake_metadata({})
