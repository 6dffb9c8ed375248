"""KVDistConnector in vLLM 0.33.0's real Scheduler, with a worker-side connector over
CPU KV tensors allocated as vLLM allocates them (tests/vllm/harness.py): every
scheduler-side and worker-side call of the connector API, with exact block ids, token
counts and bytes.

A prompt of 3 full blocks and 5 tokens runs as request ``a`` (one output token); its
blocks are saved to kvdist when it finishes. vLLM's own prefix cache is then reset, so
request ``b`` (the same 3 blocks, another tail) misses vLLM's GPU cache and hits
kvdist's."""

from __future__ import annotations

import errno
import os

import pytest

vllm = pytest.importorskip("vllm", reason=os.environ.get("KVDIST_VLLM_SKIP", "needs vLLM (make vllm)"))

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvdist.errors import CacheClosedError, ConfigError  # noqa: E402
from kvdist.external import Job  # noqa: E402
from kvdist.integrations.vllm import KVDistConnector  # noqa: E402
from kvdist.storage import DiskPool  # noqa: E402
from kvdist.transfer import OFFLOAD, ONBOARD, RELOAD, SPILL  # noqa: E402

from .harness import BLOCK, LAYERS, Engine, expected, model_config, request, vllm_config  # noqa: E402

PROMPT = list(range(1, 3 * BLOCK + 6))  # 53 tokens: 3 full blocks and 5
TAIL = [7, 8, 9, 10]
NUM_BLOCKS = 32


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return model_config(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def engine(model, tmp_path):
    """make(tier="host", **kvdist cache keys, load_async=...) -> an Engine; closed after.
    The recompute policy is off unless asked for (``recompute_when_faster="true"``): the
    stand-in forward's speed would otherwise decide whether a hit is loaded."""
    made = []

    def make(tier: str = "host", layout: KVCacheLayout = KVCacheLayout.LBNHC, load_async: bool | None = None,
             tp: int = 1, num_blocks: int = NUM_BLOCKS, **cache) -> Engine:
        lines = ["cache:", "  device: cpu"]
        if tier == "host":
            lines.append("  host: {bytes: 64KiB}")  # 16 blocks of 4 KiB
        else:
            lines += ["  host: {bytes: 0}", f"  disk: {{path: {tmp_path / 'disk'}, bytes: 64KiB}}"]
        cache = {"recompute_when_faster": "false", **cache}
        disk_keys = {k: cache.pop(k) for k in list(cache) if k.startswith("disk_")}
        if disk_keys:
            lines[-1] = lines[-1][:-1] + "".join(f", {k[5:]}: {v}" for k, v in disk_keys.items()) + "}"
        lines += [f"  {k}: {v}" for k, v in cache.items()]
        (tmp_path / "kvdist.yaml").write_text("\n".join(lines) + "\n")
        extra = {} if load_async is None else {"load_async": load_async}
        e = Engine(vllm_config(model, tmp_path / "kvdist.yaml", num_blocks, **extra), num_blocks, layout, tp)
        e.tier = tier
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def rows(step, part: str = "transfers") -> list[tuple[str, list[int], list[int]]]:
    """The step's planned copies as (route, sources, destinations), grouped by route in
    order: its loads (``transfers``, issued by start_load_kv) or its saves (``saves``,
    issued by wait_for_save)."""
    t = getattr(step.out.kv_connector_metadata, part)
    out: list[tuple[str, list[int], list[int]]] = []
    for route, s, d in zip(t.routes(), t.src.tolist(), t.dst.tolist()):
        if out and out[-1][0] == route.name:
            out[-1][1].append(s)
            out[-1][2].append(d)
        else:
            out.append((route.name, [s], [d]))
    return out


def save_a(e: Engine) -> list[int]:
    """Request ``a`` runs, finishes, and its 3 full blocks are saved; vLLM's prefix cache
    is reset after. Returns a's engine block ids."""
    e.add(request("a", PROMPT))
    s1 = e.step()
    assert s1.out.num_scheduled_tokens == {"a": len(PROMPT)}
    a_blocks = list(s1.out.scheduled_new_reqs[0].block_ids[0])
    assert len(a_blocks) == 4
    # the 3 blocks a's forward completes are saved behind that forward, in step 1
    route = OFFLOAD.name if e.tier == "host" else SPILL.name
    assert rows(s1) == [] and rows(s1, "saves") == [(route, a_blocks[:3], [0, 1, 2])]
    assert s1.out.kv_connector_metadata.saves.jobs == (Job("a", "save", tuple(a_blocks[:3])),)
    assert e.connector.planner.stats()["blocks_used"] == {e.tier: 3}
    # a finished in step 1 with saves planned: vLLM keeps its blocks until the workers say
    assert e.scheduler.requests["a"].status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert not s1.kv.finished_sending and e.connector.saving() == {"a"}
    s2 = e.step()
    assert s2.out.num_scheduled_tokens == {} and rows(s2) == rows(s2, "saves") == []
    assert s2.out.kv_connector_metadata.held == {"a"}
    assert s2.kv.finished_sending == {"a"}
    assert "a" not in e.scheduler.requests  # freed once the workers said the save finished
    assert e.scheduler.reset_prefix_cache()
    return a_blocks


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


def test_a_request_finished_before_its_save_completes_keeps_its_blocks_until_then(engine):
    e = engine(simulate_async="true")  # copies run only when something waits for them
    e.add(request("a", PROMPT))
    s1 = e.step()
    a_blocks = list(s1.out.scheduled_new_reqs[0].block_ids[0])
    assert rows(s1, "saves") == [(OFFLOAD.name, a_blocks[:3], [0, 1, 2])]
    s2 = e.step()
    assert not s2.kv.finished_sending
    s3 = e.step()
    assert not s3.kv.finished_sending
    pool = e.scheduler.kv_cache_manager.block_pool
    assert "a" in e.scheduler.requests and e.connector.saving() == {"a"}
    assert [pool.blocks[i].ref_cnt for i in a_blocks] == [1, 1, 1, 1]  # not free: the save reads them
    e.worker.kvdist.synchronize()  # the save runs
    s4 = e.step()
    assert s4.kv.finished_sending == {"a"}
    assert "a" not in e.scheduler.requests and e.connector.saving() == set()
    assert [pool.blocks[i].ref_cnt for i in a_blocks] == [0, 0, 0, 0]


def test_a_steps_saves_are_issued_behind_its_forward_and_never_waited_for(engine):
    """The saves of the blocks a step's forward completes are issued by that step's
    wait_for_save (not the next step's start_load_kv), which returns with them still
    queued; get_finished names the request once they landed, in the step after."""
    e = engine(simulate_async="true")  # copies run only when something waits for them
    e.add(request("a", PROMPT))
    s1 = e.step()
    a_blocks = list(s1.out.scheduled_new_reqs[0].block_ids[0])
    assert rows(s1, "saves") == [(OFFLOAD.name, a_blocks[:3], [0, 1, 2])]
    cache = e.worker.kvdist
    assert cache.stats()["blocks_moved"] == {OFFLOAD.name: 3}  # issued in step 1
    assert cache.executor.queued() == 1 and cache.saving() == {"a"}  # and not waited for
    assert not s1.kv.finished_sending
    cache.synchronize()  # the save lands
    s2 = e.step()
    assert s2.kv.finished_sending == {"a"} and cache.stats()["blocks_moved"] == {OFFLOAD.name: 3}


def test_a_save_in_a_step_with_a_synchronous_load_copies_what_the_forward_wrote(engine):
    """vLLM calls start_load_kv before the forward when the step has a synchronous load:
    request c's blocks, computed by that forward, are saved with the bytes it wrote
    (they are read back into d's blocks, layer by layer)."""
    e = engine()
    save_a(e)
    other = [200 - t for t in range(2 * BLOCK + 3)]  # 2 full blocks and 3 tokens
    e.add(request("b", PROMPT[:3 * BLOCK] + TAIL))
    c = e.add(request("c", other))
    s3 = e.step()
    assert s3.out.scheduled_cached_reqs.num_reqs == 0 and s3.out.has_sync_kv_loads
    assert s3.out.num_scheduled_tokens == {"b": len(TAIL), "c": len(other)}
    c_blocks = e.blocks("c")
    assert rows(s3, "saves") == [(OFFLOAD.name, c_blocks[:2], [3, 4])]
    assert e.step().kv.finished_sending == {"c"}  # b saved nothing: freed at once
    assert e.scheduler.reset_prefix_cache()
    d = e.add(request("d", other[:2 * BLOCK] + TAIL))
    s5 = e.step()
    assert s5.out.num_scheduled_tokens == {"d": len(TAIL)}
    assert rows(s5) == [(ONBOARD.name, [3, 4], list(s5.out.scheduled_new_reqs[0].block_ids[0][:2]))]
    for layer in range(len(LAYERS)):
        assert s5.heads("read", "d", layer)[:2].equal(expected(layer, c.all_token_ids, 0, 2))
        assert s5.heads("read", "d", layer)[:2].equal(expected(layer, d.all_token_ids, 0, 2))


def test_a_preempted_requests_saves_run_before_the_forward_may_write_its_freed_blocks(engine):
    """b's blocks are saved behind step 1's forward and still queued when vLLM preempts
    b for want of blocks (7 usable): the preempting step's metadata names b, and its
    forward waits for b's saves (handle_preemptions) before a writes b's freed blocks;
    kvdist's copies of b's blocks hold b's bytes (loaded into d at the end)."""
    e = engine(simulate_async="true", num_blocks=8)
    other = [200 - t for t in range(2 * BLOCK + 8)]  # 2 full blocks and 8 tokens
    e.add(request("a", PROMPT, max_tokens=30))
    b = e.add(request("b", other, max_tokens=30))
    s1 = e.step()
    b_blocks = e.blocks("b")
    assert rows(s1, "saves")[0][1][3:] == b_blocks[:2]  # a's 3 blocks, then b's 2
    executor = e.worker.kvdist.executor
    for _ in range(12):
        s = e.step()
        if s.out.preempted_req_ids:
            break
    assert s.out.preempted_req_ids == {"b"} and s.out.kv_connector_metadata.preempted == {"b"}
    assert executor.queued() == 0  # the fence ran b's saves (and what they queued behind)
    while e.scheduler.requests["a"].status == RequestStatus.RUNNING:  # a takes b's blocks
        e.step()
    for _ in range(80):
        e.worker.kvdist.synchronize()
        e.step()
        if not e.scheduler.requests:
            break
    assert not e.scheduler.requests and e.scheduler.reset_prefix_cache()
    e.add(request("d", other[:2 * BLOCK] + TAIL))
    s = e.step()
    assert s.out.num_scheduled_tokens == {"d": len(TAIL)} and rows(s)[0][1] == [3, 4]
    for layer in range(len(LAYERS)):
        assert s.heads("read", "d", layer)[:2].equal(expected(layer, b.all_token_ids, 0, 2))


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
    (tmp_path / "k.yaml").write_text("model: {num_layers: 7}\ncache: {host: {bytes: 64KiB}}\n")
    with pytest.raises(ConfigError, match=r"'model.num_layers': vLLM runs with 2: leave it out \(got 7\)"):
        Engine(vllm_config(model, tmp_path / "k.yaml", NUM_BLOCKS), NUM_BLOCKS)
    with pytest.raises(ConfigError, match=r"'kv_connector_extra_config.load_async': must be true or false"):
        Engine(vllm_config(model, tmp_path / "k.yaml", NUM_BLOCKS, load_async="yes"), NUM_BLOCKS)
    with pytest.raises(ConfigError, match=r"'kv_connector_extra_config.kvdist_cfg': unknown key"):
        Engine(vllm_config(model, tmp_path / "k.yaml", NUM_BLOCKS, kvdist_cfg="x"), NUM_BLOCKS)
