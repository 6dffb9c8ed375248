"""The public API at its edges: a call that raises leaves the cache exactly as it was,
a closed cache says so, and the step order is enforced. Each decision here is the one
the README's "Calls at the edges" table documents."""

import numpy as np
import pytest

import kvdist
import kvdist.testing
from kvdist.testing import Seams


@pytest.fixture
def seams():
    return Seams()


@pytest.fixture
def cache(cfg_factory, seams):
    c = kvdist.testing.create(cfg_factory(gpu=8), seams)
    yield c
    c.close()


def _admit(cache, seq_id, tokens):
    cache.begin_step()
    reused = cache.add_sequence(seq_id, tokens)
    cache.block_table([seq_id])
    cache.end_step()
    return reused


def _raising_generator():
    yield 1
    yield 2
    raise RuntimeError("the engine's iterator broke")


@pytest.mark.parametrize("bad, error", [
    ([1, 2, 3.5], ValueError),
    ([1, 2, 3, 4, "x"], ValueError),
    ([1, 2, 2**31], ValueError),
    (_raising_generator, RuntimeError),
])
def test_append_tokens_with_a_bad_id_changes_nothing(cache, seams, bad, error):
    _admit(cache, "a", [10, 11, 12, 13, 14, 15])  # 2 blocks of 4, the second half full
    m = seams.manager
    before = (m.state_digest(), m.seqs["a"].tokens.tolist(), list(m.seqs["a"].slots))
    cache.begin_step()
    with pytest.raises(error):
        cache.append_tokens("a", bad() if callable(bad) else bad)
    assert (m.state_digest(), m.seqs["a"].tokens.tolist(), list(m.seqs["a"].slots)) == before
    cache.check_invariants()
    assert cache.block_table(["a"]).tolist() == [[0, 1]]  # no phantom block
    cache.append_tokens("a", [16, 17, 18])  # still usable: 9 tokens, a third block
    assert cache.block_table(["a"]).tolist() == [[0, 1, 2]]
    cache.end_step()
    cache.check_invariants()


def test_token_ids_are_opaque_int32_negative_and_bool_included(cache, seams):
    """Decided: any int32 is an id (the cache hashes ids, it never indexes with them),
    negative ones included; a bool is the int it equals. Reuse sees exactly that."""
    prompt = [-1, -2, -3, -2**31, 7, 8, 9, 10, 11]
    assert _admit(cache, "neg", prompt) == 0
    assert _admit(cache, "neg again", prompt) == 8  # both full blocks reused
    assert _admit(cache, "bools", [True, False, True, False, 5]) == 0
    assert _admit(cache, "ints", [1, 0, 1, 0, 6]) == 4  # True == 1, False == 0
    cache.begin_step()
    cache.append_tokens("neg", [-5, True])
    assert seams.manager.seqs["neg"].tokens.tolist()[-2:] == [-5, 1]
    cache.end_step()
    cache.check_invariants()


@pytest.mark.parametrize("ids", ["a", b"a", "ab"])
def test_block_table_refuses_a_string_of_ids(cache, ids):
    """Decided: a str (or bytes) is not a list of sequence ids, even though Python
    would iterate it: TypeError, nothing staged."""
    _admit(cache, "a", [1, 2, 3])
    _admit(cache, "b", [4, 5, 6])
    cache.begin_step()
    staged = cache.stats()["staging"]["stages"]
    with pytest.raises(TypeError, match="list of sequence ids"):
        cache.block_table(ids)
    assert cache.stats()["staging"]["stages"] == staged
    assert cache.block_table(["a"]).tolist() == [[0]]
    cache.end_step()


def test_step_calls_out_of_order_raise_and_change_nothing(cache, seams):
    """Decided: begin_step twice and end_step without begin_step are StepOrderError,
    nothing changed. release works at any time."""
    _admit(cache, "a", [1, 2, 3, 4, 5])
    m = seams.manager
    before = (m.state_digest(), m.counters.steps)
    with pytest.raises(kvdist.StepOrderError, match="without begin_step"):
        cache.end_step()
    assert (m.state_digest(), m.counters.steps) == before
    cache.begin_step()
    with pytest.raises(kvdist.StepOrderError, match="still open"):
        cache.begin_step()
    cache.append_tokens("a", [6])
    assert cache.block_table(["a"]).tolist() == [[0, 1]]
    assert cache.block_table(["a"]).tolist() == [[0, 1]]  # more than one table in a step is fine
    cache.end_step()
    with pytest.raises(kvdist.StepOrderError, match="without begin_step"):
        cache.end_step()
    assert m.counters.steps == before[1] + 1
    cache.release("a")  # between steps
    cache.check_invariants()


@pytest.mark.parametrize("first", ["add_sequence", "append_tokens", "block_table"])
def test_a_scheduling_call_between_steps_opens_a_step(cache, seams, first):
    """Decided: add_sequence, append_tokens or block_table between steps opens the step
    itself, exactly as begin_step would (S4: the compute stream's work so far is what
    the step's copies wait for); end_step closes it; begin_step inside it is refused."""
    _admit(cache, "a", [1, 2, 3, 4, 5])
    m = seams.manager
    steps = m.counters.steps
    call = {"add_sequence": lambda: cache.add_sequence("b", [1, 2, 3, 4, 9]),
            "append_tokens": lambda: cache.append_tokens("a", [6]),
            "block_table": lambda: cache.block_table(["a"])}[first]
    call()
    with pytest.raises(kvdist.StepOrderError, match="still open"):
        cache.begin_step()
    assert cache.block_table(["a"]).tolist() == [[0, 1]]
    cache.end_step()
    assert m.counters.steps == steps + 1
    if first == "add_sequence":  # b's first block is a's, reused
        assert cache.block_table(["b"]).tolist() == [[0, 2]]
        cache.end_step()
    cache.check_invariants()


def test_every_call_after_close_says_the_cache_is_closed(cfg_factory):
    cache = kvdist.create(cfg_factory(gpu=8, host=4, disk=4))
    _admit(cache, "a", [1, 2, 3, 4, 5])
    cache.close()
    calls = {
        "begin_step": cache.begin_step, "end_step": cache.end_step,
        "add_sequence": lambda: cache.add_sequence("b", [1]),
        "append_tokens": lambda: cache.append_tokens("a", [1]),
        "block_table": lambda: cache.block_table(["a"]), "release": lambda: cache.release("a"),
        "kv_pool": lambda: cache.kv_pool(0), "stats": cache.stats, "synchronize": cache.synchronize,
        "check_invariants": cache.check_invariants, "check_consistency": cache.check_consistency,
        "layout": lambda: cache.layout, "stage": lambda: cache.stage(np.zeros(2, np.int32)),
        "simulated_compute": lambda: cache.simulated_compute, "state_digest": cache.state_digest,
    }
    for name, call in calls.items():
        with pytest.raises(kvdist.CacheClosedError, match="the cache is closed"):
            call()
        assert isinstance(kvdist.CacheClosedError("x"), kvdist.KVDistError), name
    cache.close()  # twice: a no-op
    with cache:  # and leaving a with-block closes nothing twice either
        pass
    assert repr(cache).startswith("KVCache(rank=0/1")
