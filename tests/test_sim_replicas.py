"""The replicated main job's parts in one process: the router, think time between a
chat's turns, the scheduler's admission gate and replica-local turn order, the
prefetch gate over the cache, the one-cache ceiling replay and the integrity check of
blocks another replica wrote."""

import numpy as np
import torch

import kvdist
from kvdist.config import WorkloadConfig
from kvdist.sim.engine.scheduler import Scheduler
from kvdist.sim.experiment.admission import PrefetchGate
from kvdist.sim.experiment.ceiling import StepLog, StepRecord, replay, schedule_log
from kvdist.sim.experiment.integrity import BlockLedger
from kvdist.sim.experiment.router import route, split
from kvdist.sim.experiment.workload import Request, Trace, generate

from .conftest import make_cfg

W = dict(requests=200, seed=3, system_prompts=4, system_prompt_tokens=32, conversations=12, turns=(2, 6),
         user_tokens=(8, 20), output_tokens=(2, 9), arrival_rate=1.5, max_batch=6, max_prefill_tokens=400,
         vocab_size=97, hidden=32)


def req(rid, prompt, *, chat=0, turn=0, arrival=0, after=-1, output=(1, 2)):
    return Request(rid, chat, turn, arrival, np.asarray(prompt, np.int32), np.asarray(output, np.int32),
                   after)


# -- the router ---------------------------------------------------------------------------------
def test_round_robin_spreads_a_chats_turns_over_the_replicas():
    trace = generate(WorkloadConfig(**W))
    routes = route(trace, 3, "round_robin", 4)
    assert routes.tolist() == [i % 3 for i in range(len(trace.requests))]
    follow = [r for r in trace.requests if r.after >= 0]
    away = sum(routes[r.after] != routes[r.rid] for r in follow)
    assert away > len(follow) / 2  # about 2/3 with three replicas


def test_sticky_keeps_a_chat_on_one_replica_and_spreads_chats():
    trace = generate(WorkloadConfig(**W))
    routes = route(trace, 2, "sticky", 4)
    home = {}
    for r in trace.requests:
        assert home.setdefault(r.chat, routes[r.rid]) == routes[r.rid]
    firsts = sorted({r.chat for r in trace.requests}, key=lambda c: min(q.rid for q in trace.requests
                                                                         if q.chat == c))
    assert [home[c] for c in firsts] == [i % 2 for i in range(len(firsts))]


def test_prefix_routing_follows_the_longest_prefix_it_sent():
    s1, s2 = list(range(8)), list(range(50, 58))  # two system prompts of two blocks
    trace = Trace([req(0, s1 + [9, 9, 9, 9]), req(1, s2 + [8, 8, 8, 8]), req(2, s1 + [7, 7, 7, 7]),
                   req(3, s2 + [8, 8, 8, 8, 1, 1, 1, 1], after=1), req(4, [3] * 12)], [])
    # 0: nothing known anywhere, equal loads -> replica 0; 1: nothing known, replica 1 has less
    # load; 2: replica 0 was sent s1; 3: replica 1 was sent its first three blocks; 4: nothing
    # known, replica 0 has 24 prompt tokens, replica 1 28 -> replica 0.
    assert route(trace, 2, "prefix", 4).tolist() == [0, 1, 0, 1, 0]
    gen = generate(WorkloadConfig(**W))
    routes = route(gen, 2, "prefix", 4)
    assert all(routes[r.after] == routes[r.rid] for r in gen.requests if r.after >= 0)


def test_split_keeps_arrival_order():
    trace = generate(WorkloadConfig(**W))
    routes = route(trace, 2, "round_robin", 4)
    parts = [split(trace, routes, k) for k in (0, 1)]
    assert [r.rid for r in parts[1].requests] == list(range(1, len(trace.requests), 2))
    assert sum(len(p.requests) for p in parts) == len(trace.requests)


# -- think time -----------------------------------------------------------------------------------
def test_a_chats_next_turn_waits_for_the_reply_and_the_think_time():
    w = WorkloadConfig(**{**W, "think_steps": 15})
    reqs = generate(w).requests
    follow = [r for r in reqs if r.after >= 0]
    assert follow
    for r in follow:
        prev = reqs[r.after]
        assert r.arrival >= prev.arrival + len(prev.output) + 15
    assert any(r.arrival - reqs[r.after].arrival < 15 for r in generate(WorkloadConfig(**W)).requests
               if r.after >= 0)  # without think time turns come closer


# -- the scheduler of one replica -----------------------------------------------------------------
class HoldFor:
    """A gate that holds each request back for ``steps`` calls after its start."""

    def __init__(self, steps):
        self.steps, self.calls, self.started = steps, {}, []

    def start(self, req):
        self.started.append(req.rid)

    def ready(self, started):
        assert all(r.rid in self.started for r in started)
        for r in started:
            self.calls[r.rid] = self.calls.get(r.rid, 0) + 1
        return {r.rid for r in started if self.calls[r.rid] > self.steps}


def drain_gated(sched):
    plans = []
    while not sched.done():
        plan = sched.next_step()
        plans.append((plan.clock, [r.req.rid for r in plan.prefills], [r.req.rid for r in plan.decodes]))
        assert sched.reserved == sum(r.reserved for r in sched.running) + sum(sched._ahead.values())
        assert sched.reserved <= sched.gpu_blocks
        sched.complete(plan)
    return plans


def test_gated_admission_waits_and_turns_served_elsewhere_do_not_block():
    # Request 1 continues request 0, which another replica serves: it is runnable at once.
    share = Trace([req(1, range(10), after=0, output=(1, 2, 3)), req(2, range(20, 30), arrival=1)], [])
    gate = HoldFor(2)
    sched = Scheduler(share, max_batch=4, max_prefill_tokens=100, gpu_blocks=20, tokens_per_block=4,
                      gate=gate)
    # steps 0, 1: request 1 held (empty steps); 2: admitted; request 2 arrived at 1, held 1-2, in at 3
    assert drain_gated(sched) == [(0, [], []), (1, [], []), (2, [1], []), (3, [2], [1]), (4, [], [1, 2])]
    assert gate.started == [1, 2]


def test_gated_requests_hold_their_blocks_from_the_prefetch_on():
    """A prefetch may land blocks in the GPU tier before its request is admitted: the
    request's worst case is reserved before the prefetch starts, so running requests
    can always grow. Three requests of 3 blocks, 6 blocks: the third starts only when
    the first finishes."""
    share = Trace([req(k, range(10 * k, 10 * k + 10), output=(1, 2, 3)) for k in range(3)], [])
    gate = HoldFor(1)
    sched = Scheduler(share, max_batch=4, max_prefill_tokens=100, gpu_blocks=6, tokens_per_block=4, gate=gate)
    plans = drain_gated(sched)
    assert plans == [(0, [], []), (1, [0, 1], []), (2, [], [0, 1]), (3, [], [0, 1]), (4, [], []),
                     (5, [2], []), (6, [], [2]), (7, [], [2])]
    assert gate.started == [0, 1, 2]


def test_time_kept_outside_the_scheduler():
    """A replica's clock is the wall clock: the scheduler only says until when it is
    idle, and arrivals up to the clock it is advanced to become visible."""
    share = Trace([req(0, range(8), arrival=5), req(1, range(8, 16), arrival=9)], [])
    sched = Scheduler(share, max_batch=4, max_prefill_tokens=100, gpu_blocks=20, tokens_per_block=4)
    assert sched.idle_until() == 5
    sched.advance(7)
    plan = sched.next_step()
    assert (plan.clock, [r.req.rid for r in plan.prefills]) == (7, [0])
    assert sched.idle_until() is None  # request 0 runs
    sched.complete(plan)
    sched.advance(6)  # never back
    plan = sched.next_step()
    assert (plan.clock, [r.req.rid for r in plan.prefills], [r.req.rid for r in plan.decodes]) == (8, [], [0])
    sched.complete(plan)
    assert sched.idle_until() == 9


# -- the prefetch gate over the cache -------------------------------------------------------------
# -- the prefetch gate over the cache -------------------------------------------------------------
class FakeCache:
    """Prefetch bookkeeping as the cache exposes it: ``blocks[rid]`` blocks to fetch,
    ready once ``landed`` holds the id."""

    def __init__(self, blocks):
        self.blocks, self.landed, self.prefetches = blocks, set(), []

    def prefetch(self, seq_id, tokens):
        self.prefetches.append(seq_id)
        return self.blocks.get(seq_id, 0)

    def prefetch_ready(self, seq_id):
        return self.blocks.get(seq_id, 0) == 0 or seq_id in self.landed


def test_prefetch_gate_starts_each_prefetch_once_and_admits_what_landed():
    cache = FakeCache({1: 3, 2: 2})
    gate = PrefetchGate(cache)
    a, b, c = req(0, range(8)), req(1, range(8)), req(2, range(8))
    for r in (a, b, c):
        gate.start(r)
    assert cache.prefetches == [0, 1, 2] and gate.prefetched == 2  # nothing to fetch for 0
    assert gate.ready([a, b, c]) == {0}
    assert gate.ready([b, c]) == set()
    cache.landed.add(2)
    assert gate.ready([b, c]) == {2}
    cache.landed.add(1)
    assert gate.ready([b]) == {1}
    assert gate.held == 2 and cache.prefetches == [0, 1, 2]


def test_prefetch_gate_over_a_real_cache_admits_at_once_without_remote_blocks():
    cache = kvdist.create(make_cfg(cache={"gpu": {"blocks": 16}}))
    try:
        gate = PrefetchGate(cache)
        cache.begin_step()  # a prefetch belongs to a step (it may evict, like add_sequence)
        gate.start(req(0, range(9)))
        assert gate.ready([req(0, range(9))]) == {0} and gate.prefetched == 0
        cache.end_step()
    finally:
        cache.close()


# -- the one-cache ceiling --------------------------------------------------------------------------
def replica_logs(trace, w, gpu_blocks, tpb, replicas=2):
    """Each replica's ungated schedule of its round-robin share of ``trace``."""
    routes = route(trace, replicas, "round_robin", tpb)
    return [schedule_log(part, Scheduler(part, max_batch=w.max_batch, max_prefill_tokens=w.max_prefill_tokens,
                                         gpu_blocks=gpu_blocks, tokens_per_block=tpb))
            for part in (split(trace, routes, k) for k in range(replicas))]


def test_ceiling_reuses_across_replicas_what_isolated_replicas_recompute():
    cfg = kvdist.load_config(make_cfg(cache={"gpu": {"blocks": 8}}))
    a = req(0, range(8), output=(5, 6))
    b = req(1, list(range(8)) + [5, 6, 7, 7], output=(1, 2), after=0)
    trace = Trace([a, b], [])
    one = StepLog([StepRecord(0, [0], [], []), StepRecord(1, [], [(0, 5)], [0])])
    two = StepLog([StepRecord(4, [1], [], []), StepRecord(5, [], [(1, 1)], [1])])
    cap = {"gpu": 8}
    assert replay(cfg, trace, [one], cap, 35) == {"gpu": 0}
    assert replay(cfg, trace, [two], cap, 35) == {"gpu": 0}  # replica 1 alone never saw a's blocks
    # One cache: a's two full blocks (its decoded 5 never filled a third one).
    assert replay(cfg, trace, [one, two], cap, 35) == {"gpu": 8}
    assert replay(cfg, trace, [two, one], cap, 35) == {"gpu": 8}  # merged by clock, not by order


def test_ceiling_keeps_each_replicas_steps_apart_within_one_tick():
    """Replica 0 serves a, then b (a's next turn), in two steps of one tick of the wall
    clock: merged with the other replica's steps, they stay two steps, so b reuses a."""
    cfg = kvdist.load_config(make_cfg(cache={"gpu": {"blocks": 8}}))
    a = req(0, range(8), output=(5,))
    b = req(1, list(range(8)) + [5, 6, 7, 7], output=(1,), after=0)
    c = req(2, range(30, 38), output=(1,))
    one = StepLog([StepRecord(3, [0], [], [0]), StepRecord(3, [1], [], [1])])
    other = StepLog([StepRecord(3, [2], [], [2])])
    assert replay(cfg, Trace([a, b, c], []), [one, other], {"gpu": 8}, 35) == {"gpu": 8}


def test_ceiling_of_one_replica_is_that_replica_and_more_capacity_only_helps():
    w = WorkloadConfig(**{**W, "requests": 120})
    cfg = kvdist.load_config(make_cfg(cache={"gpu": {"blocks": 40}, "host": {"bytes": 0}}, workload=dict(w)))
    trace = generate(w)
    routes = route(trace, 2, "round_robin", 4)
    logs = replica_logs(trace, w, 40, 4)
    cap = {"gpu": 40}
    isolated = [replay(cfg, trace, [log], cap, 35)["gpu"] for log in logs]
    ceiling = replay(cfg, trace, logs, cap, 35)["gpu"]
    assert ceiling > sum(isolated) > 0
    prompts = {r.rid: len(r.prompt) for r in trace.requests}
    assert all(sum(prompts[rid] for rec in log.records for rid in rec.prefills)
               == sum(len(r.prompt) for r in split(trace, routes, k).requests) for k, log in enumerate(logs))


# -- integrity of blocks another replica wrote --------------------------------------------------------
def test_blocks_from_another_replica_are_checked_against_its_writes():
    cache = kvdist.create(make_cfg(model={"dtype": "float32"}, cache={"gpu": {"blocks": 16}}))
    try:
        mine, theirs = (BlockLedger(cache.layout, cache.device, defer=True) for _ in range(2))
        kv = torch.randn(8, 2, 2, 2, 8)
        blocks = kv.unflatten(0, (2, 4)).permute(0, 2, 3, 1, 4, 5).contiguous()
        theirs.admit("t", np.arange(8, dtype=np.int32))
        theirs.written("t", 0, kv)  # only the other replica computed these two blocks
        mine.admit("s", np.arange(8, dtype=np.int32))
        assert mine.check_reused("s", mine.digest(blocks)) == 0 and len(mine.deferred) == 2
        assert mine.settle([theirs.ref]) == 0 and mine.mismatched_blocks == 0
        bad = blocks.clone()
        bad.view(torch.int32)[1, 0, 1, 2, 0, 3] ^= 1  # one bit of block 1 as it arrived
        assert mine.check_reused("s", mine.digest(bad)) == 0  # deferred, not judged yet
        assert mine.settle([theirs.ref]) == 1 and mine.mismatched_blocks == 1
        assert mine.first_mismatch == ("sequence 's' block 1 (reused from another replica): bytes differ "
                                       "from every write")
        assert mine.check_reused("s", mine.digest(blocks)) == 0
        assert mine.settle([]) == 2 and mine.unknown_blocks == 2  # nobody wrote them: never written
        strict = BlockLedger(cache.layout, cache.device)  # one replica: judged at once
        strict.admit("s", np.arange(8, dtype=np.int32))
        assert strict.check_reused("s", strict.digest(blocks)) == 2 and not strict.deferred
    finally:
        cache.close()


# -- the shipped replicas config ------------------------------------------------------------------
def test_replicas_config_is_two_replicas_with_a_large_gap_to_close():
    """configs/replicas.yaml (``make run CONFIG=configs/replicas.yaml``, 4 ranks): every
    request fits, and on its trace isolated replicas compute far more prefill than one
    cache of their capacity would (bookkeeping-only replays of the ungated schedule)."""
    from pathlib import Path

    from kvdist.candidate import plan_capacity
    from kvdist.layout import KVLayout

    cfg = kvdist.load_config(Path(__file__).resolve().parents[1] / "configs" / "replicas.yaml")
    w = cfg.workload
    assert (cfg.distributed.tp_size, cfg.distributed.remote.enabled, w.routing) == (2, True, "round_robin")
    lay = KVLayout.from_config(cfg)
    gpu, host, _ = plan_capacity(cfg, lay, torch.device("cpu"))
    trace = generate(w)
    logs = replica_logs(trace, w, gpu, lay.tokens_per_block)
    cap = {"gpu": gpu, "host": host}
    reused = [sum(replay(cfg, trace, [log], cap, w.priority).values()) for log in logs]
    isolated = trace.prompt_tokens - sum(reused)
    ceiling = trace.prompt_tokens - sum(replay(cfg, trace, logs, cap, w.priority).values())
    assert isolated > 2 * ceiling > 0


def test_a_replicated_jobs_compare_names_its_own_configurations(capsys):
    """``run --compare`` of a job of replicas serves its own configurations (isolated,
    sharing, prefix-aware, ...): one of the main job's is a one-line mistake, exit 2."""
    from pathlib import Path

    from kvdist.cli import main

    config = Path(__file__).resolve().parents[1] / "configs" / "replicas.yaml"
    assert main(["run", "--config", str(config), "--compare", "--configs", "isolated,gpu-only",
                 "--out", "none"]) == 2
    err = capsys.readouterr().err
    assert "option '--configs'" in err
    assert "isolated, sharing, prefix-aware, prefix-aware+sharing, one-cache" in err


def _ideal_computed(trace: Trace, routes, tokens_per_block: int) -> list[int]:
    """Prompt tokens computed per routing of ``routes`` (one array per routing) when every
    replica keeps every block it ever wrote (no capacity limit): a request reuses the
    longest prefix its replica saw."""
    from kvdist.sim.experiment.workload import block_keys

    order = sorted(trace.requests, key=lambda r: r.arrival_s)
    written = {r.rid: block_keys(np.concatenate([r.prompt, r.output[:-1]]), tokens_per_block) for r in order}
    out = []
    for route_of in routes:
        seen: dict[int, set[bytes]] = {}
        computed = 0
        for r in order:
            keys = written[r.rid][: len(r.prompt) // tokens_per_block]
            known = seen.setdefault(int(route_of[r.rid]), set())
            hit = next((i for i, key in enumerate(keys) if key not in known), len(keys))
            computed += len(r.prompt) - hit * tokens_per_block
            known.update(written[r.rid])
        out.append(computed)
    return out


def test_h200_replicas_trace_has_isolated_replicas_recompute_what_the_other_holds():
    """configs/h200-replicas.yaml: even with caches that forget nothing, round-robin
    isolated replicas compute over 15% of the prompt tokens more than one cache, nearly
    all of it whole contexts a user's earlier question left on the other replica (the
    chat trace it replaced gave 9.8%: the other replica held most of a chat's history;
    with the tiers' capacities the gap grows, isolated replicas holding contexts twice)."""
    from pathlib import Path

    cfg = kvdist.load_config(Path(__file__).resolve().parents[1] / "configs" / "h200-replicas.yaml")
    w, tpb = cfg.workload, cfg.cache.tokens_per_block
    trace = generate(w)
    n = len(trace.requests)
    order = sorted(range(n), key=lambda i: trace.requests[i].arrival_s)
    rr = np.empty(n, dtype=np.int64)
    rr[[trace.requests[i].rid for i in order]] = np.arange(n) % 2  # the k-th arrival to replica k mod 2
    isolated, one = _ideal_computed(trace, [rr, np.zeros(n, dtype=np.int64)], tpb)
    gap = isolated - one
    assert gap > 0.15 * trace.prompt_tokens, (gap, trace.prompt_tokens)
    long_first = sum(1 for r in trace.requests if r.turn == 0)
    assert long_first < n / 2  # one cache computes most requests' prompts from a short question
    assert gap > (w.system_prompt_tokens // tpb) * tpb * (n - long_first) / 4  # whole contexts


def test_the_ceilings_scale_capacity_and_the_batch_only_where_asked():
    from pathlib import Path

    from kvdist.sim.experiment.replica_compare import REPLICA_CONFIGS, ceiling_config

    cfg = kvdist.load_config(Path(__file__).resolve().parents[1] / "configs" / "replicas.yaml")
    w = cfg.workload
    cap = {"gpu": 160, "host": 4096}
    both = ceiling_config(cfg, 2, cap, 8192, batch=True)
    same = ceiling_config(cfg, 2, cap, 8192, batch=False)
    for c in (both, same):
        assert (c.cache.gpu.blocks, c.cache.host.bytes) == (320, 2 * 4096 * 8192)
    limits = [(c.workload.max_batch, c.workload.max_prefill_tokens) for c in (both, same)]
    assert limits == [(2 * w.max_batch, 2 * w.max_prefill_tokens), (w.max_batch, w.max_prefill_tokens)]
    assert REPLICA_CONFIGS["one-cache"][2:] == (True, True)
    assert REPLICA_CONFIGS["one-cache-same-batch"][2:] == (True, False)


def test_goal_ratios_divide_the_configurations_that_ran():
    from kvdist.sim.experiment.replica_compare import goal_ratios

    def run(p50, tps):
        return {"latency": {"ttft_ms": {"p50": p50}, "prompt_tokens_per_s": tps}}

    runs = {"isolated": run(200.0, 1000.0), "sharing": run(100.0, 1300.0), "one-cache": run(80.0, 1400.0)}
    got = {g["what"]: (g["ratio"], g["goal"], g["met"]) for g in goal_ratios(runs)}
    assert got == {"TTFT p50 sharing / isolated": (0.5, "<= 0.6", True),
                   "TTFT p50 sharing / one-cache": (1.25, "<= 1.15", False),
                   "prompt tok/s sharing / isolated": (1.3, ">= 1.2", True)}
