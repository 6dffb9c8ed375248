"""KVDistConnector's saves in vLLM 0.33.0's real Scheduler (tests/vllm/harness.py): a
step's saves issued by its own ``wait_for_save``, behind its forward, never waited for;
a finished request's blocks held until its saves landed; a preempted request's saves run
before the next forward may write its freed blocks. Exact block ids and bytes."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm", reason=os.environ.get("KVDIST_VLLM_SKIP", "needs vLLM (make vllm)"))

from vllm.v1.request import RequestStatus  # noqa: E402

from kvdist.transfer import OFFLOAD, ONBOARD  # noqa: E402

from .harness import BLOCK, LAYERS, PROMPT, TAIL, expected, request, rows, save_a  # noqa: E402


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
