"""The simulation's parts in one process: the trace generator, the scheduler, the
tiny model against a real cache, the integrity ledger, the replays, the report and
the metrics endpoint — and a whole short run, clean and with a corrupted block."""

import json
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

import kvdist
from kvdist.candidate import plan_capacity
from kvdist.config import WorkloadConfig
from kvdist.layout import KVLayout
from kvdist.sim.engine.model import Decoder, Geometry, Segment
from kvdist.sim.engine.parallel import TensorParallel
from kvdist.sim.engine.scheduler import Scheduler
from kvdist.sim.experiment.clock import Latencies
from kvdist.sim.experiment.integrity import BlockLedger
from kvdist.sim.experiment.job import run, solo
from kvdist.sim.experiment.metrics import MetricsServer, snapshot_from
from kvdist.sim.experiment.options import RunOptions
from kvdist.sim.experiment.report import REQUIRED_KEYS
from kvdist.sim.experiment.timing import CACHE_CALLS
from kvdist.sim.experiment.workload import Request, Trace, generate

from .conftest import make_cfg

W = dict(requests=120, seed=3, system_prompts=3, system_prompt_tokens=40, conversations=10, turns=(2, 5),
         user_tokens=(3, 20), output_tokens=(2, 9), arrival_rate=1.5, max_batch=6, max_prefill_tokens=200,
         vocab_size=97, hidden=32, verify_logits_every=1)


def sim_cfg(tmp_path, **workload):
    return kvdist.load_config(make_cfg(
        model={"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"},
        cache={"device": "cpu", "gpu": {"blocks": 64}, "host": {"bytes": 24 * 1024},
               "disk": {"path": str(tmp_path / "disk"), "bytes": 400 * 1024},
               "recompute_when_faster": False},  # measured timings would make reuse vary
        distributed={"check_consistency_every": 7}, workload={**W, **workload}))


# -- the trace ----------------------------------------------------------------------------------
def test_trace_is_a_pure_function_of_the_seed():
    a, b = generate(WorkloadConfig(**W)), generate(WorkloadConfig(**W))
    assert [(r.rid, r.chat, r.turn, r.arrival, r.after) for r in a.requests] == \
        [(r.rid, r.chat, r.turn, r.arrival, r.after) for r in b.requests]
    assert all(np.array_equal(x.prompt, y.prompt) and np.array_equal(x.output, y.output)
               for x, y in zip(a.requests, b.requests))
    c = generate(WorkloadConfig(**{**W, "seed": 4}))
    assert any(not np.array_equal(x.prompt, y.prompt) for x, y in zip(a.requests, c.requests))


def test_chats_resend_their_history_after_a_shared_system_prompt():
    w = WorkloadConfig(**W)
    trace = generate(w)
    reqs = trace.requests
    assert len(reqs) == w.requests and [r.rid for r in reqs] == list(range(w.requests))
    for r in reqs:
        assert w.output_tokens[0] <= len(r.output) <= w.output_tokens[1]
        assert r.prompt.dtype == np.int32 and r.prompt.max() < w.vocab_size
        if r.after < 0:
            assert r.turn == 0
            assert any(np.array_equal(r.prompt[: w.system_prompt_tokens], s) for s in trace.system_prompts)
            assert w.user_tokens[0] <= len(r.prompt) - w.system_prompt_tokens <= w.user_tokens[1]
        else:
            prev = reqs[r.after]
            assert prev.chat == r.chat and r.turn == prev.turn + 1 and prev.arrival <= r.arrival
            history = np.concatenate([prev.prompt, prev.output])
            assert np.array_equal(r.prompt[: len(history)], history)
            assert w.user_tokens[0] <= len(r.prompt) - len(history) <= w.user_tokens[1]
    turns = {}
    for r in reqs:
        turns[r.chat] = r.turn + 1
    finished = [n for chat, n in turns.items() if chat < max(turns) - w.conversations]
    assert finished and all(w.turns[0] <= n <= w.turns[1] for n in finished)


def test_arrivals_are_poisson_at_the_configured_rate():
    w = WorkloadConfig(**{**W, "requests": 4000, "arrival_rate": 2.5})
    arrivals = np.array([r.arrival for r in generate(w).requests])
    assert (np.diff(arrivals) >= 0).all()
    per_step = np.bincount(arrivals)
    assert abs(per_step.mean() - 2.5) < 0.15
    assert abs(per_step.var() - 2.5) < 0.4  # Poisson: variance equals the mean


def test_distinct_blocks_counts_shared_prefixes_once():
    w = WorkloadConfig(**{**W, "requests": 1, "system_prompt_tokens": 32, "user_tokens": (16, 16),
                          "output_tokens": (17, 17)})
    trace = generate(w)
    assert trace.distinct_blocks(16) == (32 + 16 + 16) // 16
    trace.requests.append(trace.requests[0])  # the same request again adds nothing
    assert trace.distinct_blocks(16) == 4


# -- the scheduler ------------------------------------------------------------------------------
def drain(sched):
    plans = []
    while not sched.done():
        plan = sched.next_step()
        plans.append(([r.req.rid for r in plan.prefills], [(r.req.rid, r.generated) for r in plan.decodes]))
        sched.complete(plan)
    return plans


def test_scheduler_limits_and_order():
    w = WorkloadConfig(**W)
    trace = generate(w)
    sched = Scheduler(trace, max_batch=w.max_batch, max_prefill_tokens=w.max_prefill_tokens,
                      gpu_blocks=40, tokens_per_block=4)
    finished_at, steps_of = {}, {}
    while not sched.done():
        plan = sched.next_step()
        assert len(plan.batch) <= w.max_batch
        assert sched.reserved <= 40
        assert sum(r.reserved for r in sched.running) == sched.reserved
        prefill = sum(len(r.req.prompt) for r in plan.prefills)
        assert prefill <= w.max_prefill_tokens or len(plan.prefills) == 1
        for r in plan.prefills:
            assert r.req.arrival <= sched.clock
            assert r.req.after < 0 or r.req.after in finished_at, "a turn overtook the previous one"
        for r in plan.batch:
            steps_of[r.req.rid] = steps_of.get(r.req.rid, 0) + 1
        for r in sched.complete(plan):
            finished_at[r.req.rid] = sched.step
    assert sorted(finished_at) == list(range(w.requests))
    assert all(steps_of[r.rid] == len(r.output) for r in trace.requests)


def test_scheduler_is_deterministic_and_refuses_a_request_that_cannot_fit():
    w = WorkloadConfig(**W)
    mk = lambda: Scheduler(generate(w), max_batch=4, max_prefill_tokens=100, gpu_blocks=40,
                           tokens_per_block=4)
    assert drain(mk()) == drain(mk())
    with pytest.raises(kvdist.ConfigError, match="cache.gpu"):
        Scheduler(generate(w), max_batch=4, max_prefill_tokens=100, gpu_blocks=10, tokens_per_block=4)


def test_upcoming_is_what_the_next_step_could_admit_in_line():
    def req(rid, n, after=-1, arrival=0):
        return Request(rid, chat=rid, turn=0, arrival=arrival, prompt=np.arange(n, dtype=np.int32),
                       output=np.zeros(3, np.int32), after=after)

    # 0 holds the GPU tier (11 of 14 blocks); 1 is 0's next turn; 5 has not arrived.
    trace = Trace([req(0, 40), req(1, 40, after=0), req(2, 30), req(3, 50), req(4, 10),
                   req(5, 10, arrival=5)], system_prompts=[])

    def first_step(**limits):
        sched = Scheduler(trace, gpu_blocks=14, tokens_per_block=4, **limits)
        assert [r.req.rid for r in sched.next_step().prefills] == [0]
        return sched

    # In line: 2, 3, 4 (1 waits for 0's reply): as many as one step's limits admit.
    assert [r.rid for r in first_step(max_batch=8, max_prefill_tokens=85).upcoming()] == [2, 3]
    assert [r.rid for r in first_step(max_batch=8, max_prefill_tokens=90).upcoming()] == [2, 3, 4]
    assert [r.rid for r in first_step(max_batch=2, max_prefill_tokens=90).upcoming()] == [2, 3]
    # At least one, however long.
    assert [r.rid for r in first_step(max_batch=8, max_prefill_tokens=20).upcoming()] == [2]
    sched = Scheduler(trace, max_batch=8, max_prefill_tokens=200, gpu_blocks=14, tokens_per_block=4)
    for _ in range(3):  # 0 prefills, decodes twice and finishes: its next turn joins the line
        sched.complete(sched.next_step())
    assert [r.req.rid for r in sched.running] == [] and sched.finished == 1
    assert [r.rid for r in sched.upcoming()] == [1, 2, 3, 4]


# -- the model against a cache ------------------------------------------------------------------
def test_cached_forward_equals_a_from_scratch_recompute(tmp_path):
    cfg = sim_cfg(tmp_path)
    cache = kvdist.create(cfg)
    tp = TensorParallel()
    try:
        lay = cache.layout
        g = Geometry(lay.num_layers, lay.num_kv_heads, lay.head_dim, q_per_kv=2, hidden=32, ffn=48, vocab=97)
        model = Decoder(g, seed=1, tp=tp, device=cache.device, kv_dtype=torch.float32,
                        compute_dtype=torch.float32, tokens_per_block=lay.tokens_per_block)
        rng = np.random.default_rng(0)
        a = rng.integers(0, 97, 23).astype(np.int32)
        b = rng.integers(0, 97, 9).astype(np.int32)
        # step 1: sequence 0 prefilled whole, sequence 1 prefilled with the first 11 tokens
        cache.begin_step()
        cache.add_sequence(0, a.tolist())
        cache.add_sequence(1, b.tolist())
        table = cache.block_table([0, 1])
        logits, written = model.forward_cached(cache, table, [Segment(0, 0, a), Segment(1, 0, b)])
        cache.end_step()
        assert written.shape == (32, 2, 2, 2, 8)
        for i, toks in enumerate((a, b)):
            torch.testing.assert_close(logits[i], model.forward_dense(toks), rtol=0, atol=1e-4)
        # step 2: both decode one token (batched decode path)
        cache.begin_step()
        cache.append_tokens(0, [5])
        cache.append_tokens(1, [7])
        table = cache.block_table([0, 1])
        logits, _ = model.forward_cached(cache, table, [Segment(0, 23, np.array([5], np.int32)),
                                                        Segment(1, 9, np.array([7], np.int32))])
        cache.end_step()
        torch.testing.assert_close(logits[0], model.forward_dense(np.append(a, 5)), rtol=0, atol=1e-4)
        torch.testing.assert_close(logits[1], model.forward_dense(np.append(b, 7)), rtol=0, atol=1e-4)
        # step 3: a new prompt reuses sequence 0's full blocks and computes only the rest
        cache.release(0)
        c = np.concatenate([a, [5], rng.integers(0, 97, 6).astype(np.int32)])
        cache.begin_step()
        reused = cache.add_sequence(2, c.tolist())
        assert reused == 24  # six full blocks, the last one completed by the decode step
        table = cache.block_table([2])
        logits, written = model.forward_cached(cache, table, [Segment(0, reused, c[reused:])])
        cache.end_step()
        assert written.shape[0] == len(c) - 24
        torch.testing.assert_close(logits[0], model.forward_dense(c), rtol=0, atol=1e-4)
    finally:
        cache.close()
        tp.free()


# -- the integrity ledger -----------------------------------------------------------------------
def test_ledger_digest_notices_one_changed_bit_and_unknown_blocks(tmp_path):
    cache = kvdist.create(sim_cfg(tmp_path))
    try:
        ledger = BlockLedger(cache.layout, cache.device)
        L, H, D, tpb = 2, 2, 8, 4
        kv = torch.randn(9, L, 2, H, D)
        ledger.admit("s", np.arange(9, dtype=np.int32))
        ledger.written("s", 0, kv[:6])
        ledger.written("s", 6, kv[6:], appended=None)
        assert len(ledger.ref) == 2  # block 1 (tokens 4-7) spans both writes: its shares carried over
        blocks = kv[:8].unflatten(0, (2, tpb)).permute(0, 2, 3, 1, 4, 5).contiguous()
        good = ledger.digest(blocks)
        assert ledger.check_reused("s", good) == 0
        flipped = blocks.clone()
        flipped.view(torch.int32)[1, 1, 0, 2, 1, 3] ^= 1  # one bit of one word of block 1
        assert ledger.check_reused("s", ledger.digest(flipped)) == 1
        ledger.admit("t", np.arange(100, 108, dtype=np.int32))  # never written
        assert ledger.check_reused("t", good) == 2
        assert (ledger.checked_blocks, ledger.mismatched_blocks, ledger.unknown_blocks) == (6, 3, 2)
        # A second, different write of the same prefix is a legitimate variant.
        ledger.admit("u", np.arange(9, dtype=np.int32))
        ledger.written("u", 0, kv[:8] + 1)
        assert ledger.variants == 2 and ledger.check_reused("u", ledger.digest(blocks + 1)) == 0
    finally:
        cache.close()


# -- whole runs at world size 1 ----------------------------------------------------------------
@pytest.mark.parametrize("simulate_async", [False, True], ids=["sync", "simulated-async"])
def test_short_run_reuses_every_tier_with_zero_mismatches(tmp_path, simulate_async):
    cfg = sim_cfg(tmp_path).replace(cache={"simulate_async": simulate_async})
    r = run(cfg, RunOptions(out=str(tmp_path / "runs"), progress=False))
    assert r["ok"] and r["integrity_mismatches"] == 0
    assert all(r["reused_tokens"][t] > 0 for t in ("gpu", "host", "disk")), r["reused_tokens"]
    # The requests next in line had their disk blocks moved to the host tier ahead.
    assert r["blocks_moved_per_rank"]["promote"] > 0, r["blocks_moved_per_rank"]
    calls = r["cache_calls_us_per_step"]  # each call timed on its own, inside the cache's time
    assert list(calls) == list(CACHE_CALLS) and all(us > 0 for us in calls.values()), calls
    assert sum(calls.values()) <= r["cache_api_us_per_step"]
    assert r["requests"] == W["requests"] and r["world_size"] == 1
    i = r["integrity"]
    assert i["blocks_checked"] * 4 == sum(r["reused_tokens"].values())
    assert i["logits_checked"] > 10 and i["logits_failed"] == 0 and i["logits_max_abs_diff"] < 1e-4
    assert i["consistency"] == {"checks": r["steps"] // 7, "error": None}
    computed = r["prefill_tokens_computed"]
    assert computed["no reuse"] == r["prompt_tokens"]
    assert computed["this run"] == r["prompt_tokens"] - sum(r["reused_tokens"].values())
    assert computed["this run"] < computed["gpu-only"] < computed["no reuse"]
    latest = tmp_path / "runs" / "latest"
    assert latest.is_symlink() and latest.resolve() == Path(r["run_dir"]).resolve()
    saved = json.loads((latest / "results.json").read_text(encoding="utf-8"))
    assert all(k in saved for k in REQUIRED_KEYS) and saved["reused_tokens"] == r["reused_tokens"]
    for png in ("hit_rate.png", "occupancy.png", "bytes_moved.png"):
        assert (latest / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    timeline = json.loads((latest / "timeline.json").read_text(encoding="utf-8"))
    assert len(timeline["prompt_tokens"]) == r["steps"]
    assert timeline["prompt_tokens"][-1] == r["prompt_tokens"]


@pytest.mark.parametrize("ahead", [False, True], ids=["serial", "run-ahead"])
def test_a_corrupted_block_is_caught_by_both_checks(tmp_path, monkeypatch, ahead):
    """Rule off: the cache hands back a reused block whose K was overwritten. The
    digest check and the logits check must both report it, and the run fails (running
    ahead too, where the digests are compared a step or more later)."""
    corrupted, reused_now = [], {}
    real_create = kvdist.sim.experiment.parts.create

    class CorruptingCache:
        """The cache, but a reused block's K is overwritten once it is handed back."""

        def __init__(self, cache):
            self.cache = cache

        def __getattr__(self, name):
            return getattr(self.cache, name)

        def add_sequence(self, seq_id, tokens, priority=35):
            reused_now[seq_id] = self.cache.add_sequence(seq_id, tokens, priority)
            return reused_now[seq_id]

        def block_table(self, seq_ids):
            table = self.cache.block_table(seq_ids)
            for row, seq_id in enumerate(seq_ids):
                if not corrupted and reused_now.get(seq_id, 0) >= 8:  # two reused blocks
                    self.cache.kv_pool(0)[table[row, 1], 0] += 1.0  # K of block 1, layer 0
                    corrupted.append(seq_id)
            reused_now.clear()
            return table

    def corrupting_create(cfg, comm=None):
        return CorruptingCache(real_create(cfg, comm))

    monkeypatch.setattr(kvdist.sim.experiment.parts, "create", corrupting_create)
    r = run(sim_cfg(tmp_path, run_ahead=ahead), RunOptions(out=None, progress=False))
    assert corrupted
    assert not r["ok"]
    assert r["integrity_mismatches"] >= 1
    assert r["integrity"]["first_mismatch"].startswith(f"sequence {corrupted[0]!r} block 1")
    assert r["integrity"]["logits_failed"] >= 1


def test_no_reuse_replay_proves_the_trace_fits(tmp_path):
    sim = solo(sim_cfg(tmp_path, requests=40), RunOptions(out=None, progress=False))
    try:
        r = sim.run()
        assert r["reused_tokens_gpu_only"] > 0
        assert sim.reporter.shadows.reused()["no reuse"] == 0
        assert r["prefill_tokens_saved"]["vs gpu-only"] == sum(r["reused_tokens"].values()) - \
            r["reused_tokens_gpu_only"]
    finally:
        sim.close()


# -- the metrics endpoint -----------------------------------------------------------------------
def test_prometheus_endpoint_serves_the_latest_snapshot(tmp_path):
    server = MetricsServer(0, host="127.0.0.1")
    try:
        stats = {"block_bytes": 512, "steps": 7, "prompt_tokens": 300, "hit_tokens": {"gpu": 40, "host": 8},
                 "blocks_used": {"gpu": 3, "host": 2}, "capacity_blocks": {"gpu": 8, "host": 4},
                 "blocks_moved": {"offload": 5, "onboard": 2}, "transfer_seconds": 0.25}
        server.update(snapshot_from(stats, requests_done=11, mismatches=0))
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5).read().decode()
        lines = set(body.splitlines())
        assert 'kvdist_reused_tokens_total{tier="gpu"} 40' in lines
        assert 'kvdist_bytes_moved_total{direction="offload"} 2560' in lines
        assert "kvdist_requests_finished_total 11" in lines and "# TYPE kvdist_blocks_used gauge" in lines
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/other", timeout=5)
    finally:
        server.close()


def test_metrics_listen_on_loopback_by_default_and_counters_are_exact_integers():
    server = MetricsServer(0)
    try:
        assert server._httpd.server_address[0] == "127.0.0.1"  # not the network, unless asked
        stats = {"block_bytes": 16384, "steps": 3059, "prompt_tokens": 700214, "hit_tokens": {"gpu": 421088},
                 "blocks_used": {"gpu": 256}, "capacity_blocks": {"gpu": 256},
                 "blocks_moved": {"offload": 17713, "spill": 3}, "transfer_seconds": 0.1}
        server.update(snapshot_from(stats, requests_done=1500, mismatches=0))
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5).read().decode()
        lines = set(body.splitlines())
        assert 'kvdist_bytes_moved_total{direction="offload"} 290209792' in lines  # not 2.9021e+08
        assert 'kvdist_bytes_moved_total{direction="spill"} 49152' in lines
        assert "kvdist_prompt_tokens_total 700214" in lines and "kvdist_transfer_seconds_total 0.1" in lines
    finally:
        server.close()
    from kvdist import cli

    assert cli._parser().parse_args(["run", "--metrics-host", "0.0.0.0"]).metrics_host == "0.0.0.0"


def test_readme_documents_every_metric_label_value():
    """Each label value the endpoint can carry (tiers, copy directions) is in the README."""
    from kvdist.sim.experiment.metrics import MOVES, TIERS

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("| metric | labels | what |"):]
    section = section[: section.index("\n\n")]
    for value in (*TIERS, *MOVES):
        assert f"`{value}`" in section, value


# -- the shipped configs ------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["default", "h200"])
def test_shipped_configs_overflow_the_gpu_tier_and_fit_every_request(name, monkeypatch):
    import kvdist.candidate

    monkeypatch.setattr(kvdist.candidate, "available_memory", lambda: 2 << 40)  # the H200 node's, not ours
    cfg = kvdist.load_config(ROOT / "configs" / f"{name}.yaml")
    lay = KVLayout.from_config(cfg)
    gpu, host, disk = plan_capacity(cfg, lay, torch.device("cpu"))
    trace = generate(cfg.workload)
    Scheduler(trace, max_batch=cfg.workload.max_batch, max_prefill_tokens=cfg.workload.max_prefill_tokens,
              gpu_blocks=gpu, tokens_per_block=lay.tokens_per_block)  # raises if a request cannot fit
    working_set = trace.distinct_blocks(lay.tokens_per_block)
    assert working_set > 4 * gpu and working_set > gpu + host and disk > 0


def test_multinode_example_is_a_valid_config(tmp_path, monkeypatch):
    import yaml

    data = yaml.safe_load((ROOT / "configs" / "multinode.yaml").read_text(encoding="utf-8"))
    data["cache"]["disk"]["path"] = str(tmp_path)  # its node-local NVMe is not here
    monkeypatch.setattr(kvdist.paths, "free_bytes", lambda directory: 1 << 50)  # nor its 128 GiB
    cfg = kvdist.load_config(data)
    assert (cfg.model.num_layers, cfg.model.num_kv_heads, cfg.cache.host.bytes) == (80, 1, "auto")


def test_default_config_comment_states_the_working_set_it_makes():
    """configs/default.yaml says how big its trace's working set is; that must be what
    the trace gives (the run's header prints the same figures)."""
    import re

    from kvdist.sim.experiment.workload import generate

    text = (ROOT / "configs" / "default.yaml").read_text(encoding="utf-8")
    said = re.search(r"working set of ([\d,]+) blocks, ([\d.]+)x the GPU", text)
    assert said, "the comment on the working set is gone"
    cfg = kvdist.load_config(ROOT / "configs" / "default.yaml")
    ws = generate(cfg.workload).distinct_blocks(cfg.cache.tokens_per_block)
    assert (int(said[1].replace(",", "")), said[2]) == (ws, f"{ws / cfg.cache.gpu.blocks:.1f}")


# -- run --compare: the trace in real time, once per configuration ----------------------------
def test_compare_serves_the_trace_three_times_in_real_time(tmp_path):
    from kvdist.sim.experiment.compare import CONFIGS, run_compare

    cfg = sim_cfg(tmp_path, requests=40, request_rate=200.0)
    r = run_compare(cfg, RunOptions(out=str(tmp_path / "runs"), progress=False))
    assert r["ok"] and list(r["runs"]) == ["all-tiers", "gpu-only", "no-reuse"]
    assert set(r["runs"]) < set(CONFIGS)
    tiers, gpu, none = (r["runs"][n] for n in ("all-tiers", "gpu-only", "no-reuse"))
    assert tiers["tiers"] == ["gpu", "host", "disk"] and gpu["tiers"] == none["tiers"] == ["gpu"]
    assert tiers["capacity_blocks"]["gpu"] == gpu["capacity_blocks"]["gpu"] == none["capacity_blocks"]["gpu"]
    assert none["reused_tokens"] == {"gpu": 0} and gpu["reused_tokens"]["gpu"] > 0
    assert sum(tiers["reused_tokens"].values()) > gpu["reused_tokens"]["gpu"]
    for run_ in r["runs"].values():
        lat = run_["latency"]
        assert run_["requests"] == lat["requests"] == 40 and len(lat["ttft_s"]) == 40
        t = lat["ttft_ms"]
        assert min(lat["ttft_s"]) > 0 and t["p50"] <= t["p90"] <= t["p99"]
        assert 0 < lat["busy_fraction"] <= 1 and lat["requests_per_s"] > 0
        assert run_["integrity_mismatches"] == 0 and run_["integrity"]["logits_failed"] == 0
    q = r["all_tiers_vs_gpu_only"]
    assert q["ttft_p50"] == tiers["latency"]["ttft_ms"]["p50"] / gpu["latency"]["ttft_ms"]["p50"]
    latest = tmp_path / "runs" / "latest"
    saved = json.loads((latest / "results.json").read_text(encoding="utf-8"))
    assert all(k in saved for k in REQUIRED_KEYS) and saved["request_rate"] == 200.0
    assert (latest / "ttft_cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_real_time_arrivals_wait_for_the_clock_and_the_previous_turn():
    w = WorkloadConfig(**{**W, "requests": 30, "request_rate": 50.0})
    trace = generate(w)
    gaps = np.diff([0.0] + [r.arrival_s for r in trace.requests])
    assert (gaps > 0).all() and 0.005 < gaps.mean() < 0.05  # exponential at 50/s
    sched = Scheduler(trace, max_batch=w.max_batch, max_prefill_tokens=w.max_prefill_tokens,
                      gpu_blocks=40, tokens_per_block=4)
    first = trace.requests[0].arrival_s
    assert sched.next_step(first / 2) is None and sched.next_arrival() == first
    plan = sched.next_step(first)
    assert [run.req.rid for run in plan.prefills] == [r.rid for r in trace.requests if r.arrival_s <= first]
    lat = Latencies()
    follow = next(r for r in trace.requests if r.after == 0)
    lat.finish[0] = follow.arrival_s + 1.0  # the previous turn finished after the next one 'arrived'
    lat.admitted(follow)
    assert lat.arrival[follow.rid] == follow.arrival_s + 1.0


def _sim_imports() -> dict[str, set[str]]:
    """Every module of ``kvdist.sim`` and the ``kvdist.sim`` modules it imports (at
    the top or inside a function; ``TYPE_CHECKING`` imports too), read with ``ast``."""
    import ast

    root = Path(kvdist.__file__).parent / "sim"
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        parts = ("kvdist", "sim", *path.relative_to(root).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                mod = f"{base}.{node.module}" if node.level and node.module else (node.module or base)
                targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t.startswith("kvdist.sim."))
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def test_the_engine_imports_nothing_of_the_experiment():
    graph = _sim_imports()
    engine = [m for m in graph if m.startswith("kvdist.sim.engine")]
    assert len(engine) >= 7, engine
    wrong = {m: sorted(d for d in graph[m] if d.startswith("kvdist.sim.experiment")) for m in engine}
    assert {m: d for m, d in wrong.items() if d} == {}


def test_no_import_circles_in_the_simulation():
    from .test_package_structure import circles

    assert circles(_sim_imports()) == []


@pytest.mark.parametrize("ahead", [False, True], ids=["serial", "run-ahead"])
def test_every_step_reports_the_tokens_its_decodes_appended(tmp_path, monkeypatch, ahead):
    """A request's decodes append its reply's tokens in order, all but the last (whose
    K/V no step writes), and the reporter (the replays, a replica's step log) records
    exactly those: taken before the scheduler moves the plan's requests on."""
    from kvdist.sim.experiment.reporters import JobReporter

    seen: dict[int, list[int]] = {}
    real_step = JobReporter.step

    def step(self, plan, appends, done):
        for rid, token in appends:
            seen.setdefault(rid, []).append(token)
        real_step(self, plan, appends, done)

    monkeypatch.setattr(JobReporter, "step", step)
    cfg = sim_cfg(tmp_path, requests=40, run_ahead=ahead)
    r = run(cfg, RunOptions(out=None, progress=False))
    assert r["ok"]
    trace = generate(cfg.workload)
    assert seen == {q.rid: q.output[:-1].tolist() for q in trace.requests if len(q.output) > 1}


def test_compare_runs_the_serial_loop_next_to_all_tiers_where_that_runs_ahead(tmp_path):
    from kvdist.sim.experiment.compare import configurations, render, run_compare

    cfg = sim_cfg(tmp_path, requests=20, request_rate=200.0)
    names = ("all-tiers", "gpu-only", "no-reuse")
    assert configurations(cfg, names, torch.device("cpu")) == list(names)
    assert configurations(cfg, names, torch.device("cuda")) == ["all-tiers", "all-tiers-serial", "gpu-only",
                                                                 "no-reuse"]
    serial = cfg.replace(workload={"run_ahead": False})
    assert configurations(serial, names, torch.device("cuda")) == list(names)
    ahead = cfg.replace(workload={"run_ahead": True})
    r = run_compare(ahead, RunOptions(out=None, progress=False, configs=("all-tiers",)))
    assert r["ok"] and list(r["runs"]) == ["all-tiers", "all-tiers-serial"]
    on, off = r["runs"]["all-tiers"], r["runs"]["all-tiers-serial"]
    assert on["critical_path"]["run_ahead"] and not off["critical_path"]["run_ahead"]
    assert on["critical_path"]["timers"] == off["critical_path"]["timers"] == "host timers"
    assert on["requests"] == off["requests"] == 20
    q = r["run_ahead_vs_serial"]
    assert q["ttft_p50"] == on["latency"]["ttft_ms"]["p50"] / off["latency"]["ttft_ms"]["p50"]
    assert "all tiers running ahead vs serial" in render(r)
