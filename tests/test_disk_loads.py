"""A request whose prefix must come from disk waits for its reads; the step never blocks
on them (vLLM v1's asynchronous loads). Its prefetch's reads are polled at each
``end_step`` and agreed by the TP group (``kvdist.loads``); ``prefetch_ready`` turns True
at the first step after they landed, and only then does the main job's scheduler
(``Scheduler`` behind ``admission.PrefetchGate``) admit it.

Simulated streams make "the step blocks on a read" visible without a GPU: a held disk
stream cannot run, so a step whose compute had to wait for a read raises
``SimDeadlock`` instead of waiting. Deterministic: nothing depends on timing."""

from __future__ import annotations

import numpy as np

import kvdist
from kvdist.seams import Seams
from kvdist.sim.engine.request import Request
from kvdist.sim.engine.scheduler import Scheduler
from kvdist.sim.experiment.admission import PrefetchGate
from kvdist.sim.experiment.job import solo
from kvdist.sim.experiment.options import RunOptions
from kvdist.testing import IntegrityDriver
from kvdist.transfer import HostCopies, SimExecutor

from .test_sim_unit import sim_cfg

A = list(range(1000, 1016)) + [7]  # 4 full blocks and one token


class _Trace:
    def __init__(self, requests: list[Request]):
        self.requests = requests


def _request(rid: int, prompt: list[int], output: int = 3) -> Request:
    return Request(rid, rid, 0, 0, np.asarray(prompt, dtype=np.int32),
                   np.arange(1, output + 1, dtype=np.int32), -1)


def _on_disk(d: IntegrityDriver) -> None:
    """``A``'s 4 blocks computed, then pushed down to disk by other prompts of its
    priority; then blocks of a priority too low to offload fill the GPU tier's coldest
    places, so that later admissions evict them (dropped) and nothing moves into the host
    tier (``offload_min_priority`` 36): no copy of the step's can follow the prefetch's
    reads through a host slot a demotion frees."""
    def run(seq_id, tokens, priority):
        d.begin(); d.add(seq_id, tokens, priority); d.compute(); d.end(); d.release(seq_id)  # noqa: E702
    run("a", A, 50)
    for i in range(20):
        run(i, [20000 + i * 100 + j for j in range(16)] + [1], 50)
    d.begin()  # in one step: a later one would evict the earlier's blocks, the coldest
    for i in range(3):
        d.add(f"low{i}", [5000 + i * 100 + j for j in range(16)] + [1], 35)
    d.compute()
    d.end()
    for i in range(3):
        d.release(f"low{i}")
    d.cache.synchronize()


def _cfg(cfg_factory) -> dict:
    return cfg_factory(gpu=24, host=8, disk=128, simulate_async=True, offload_min_priority=36)


def test_a_request_waits_for_its_disk_reads_while_the_steps_go_on(cfg_factory):
    """The main job's scheduler and gate over a cache with simulated streams, its disk
    stream held (the reads cannot run). Request 1's prefix is on disk: it is prefetched
    and held back, step after step, while request 2 (nothing cached) is admitted and
    decodes; no step waits for the read (a wait would raise SimDeadlock). Once the
    stream is released, the next end_step finds the reads done and the step after
    admits request 1, which onboards its 4 blocks from the host tier, intact."""
    seams = Seams()
    cache = kvdist.testing.create(_cfg(cfg_factory), seams)
    try:
        d = IntegrityDriver(cache)
        _on_disk(d)
        ex = seams.executor
        assert isinstance(ex, SimExecutor)
        r1, r2 = _request(1, A), _request(2, list(range(9000, 9020)), output=8)
        sched = Scheduler(_Trace([r1, r2]), max_batch=4, max_prefill_tokens=100, gpu_blocks=24,
                          tokens_per_block=4, gate=PrefetchGate(cache))
        ex.hold("promote")
        admitted: list[list[int]] = []

        def step() -> None:
            d.begin()
            plan = sched.next_step()
            for run in plan.prefills:
                d.add(run.req.rid, run.req.prompt.tolist())
            for run in plan.decodes:
                d.append(run.req.rid, [int(run.req.output[run.generated - 1])])
            if plan.batch:
                d.compute()
            d.end()
            for run in sched.complete(plan):
                d.release(run.req.rid)
            admitted.append([run.req.rid for run in plan.prefills])

        for _ in range(4):
            step()
        assert admitted == [[2], [], [], []]  # 1 waits for its reads; 2 runs
        assert not cache.prefetch_ready(1)
        assert cache.stats()["disk_loads"] == {"waiting": 1, "started": 1, "steps_waited": 4}
        ex.release("promote")
        step()  # its end_step finds the reads done, agreed
        assert admitted[-1] == [] and cache.prefetch_ready(1)
        step()
        assert admitted[-1] == [1]
        s = cache.stats()
        assert s["hit_tokens"]["host"] == 16 and s["hit_tokens"]["disk"] == 0  # onboarded from host
        assert s["disk_loads"] == {"waiting": 0, "started": 1, "steps_waited": 4}
        while not sched.done():
            step()
        assert d.mismatched_tokens == 0 and d.checked_tokens >= 16, d.first_mismatch
    finally:
        seams.executor.release("promote")
        cache.close()


def test_the_tp_group_waits_for_the_slowest_rank_s_reads(cfg_factory):
    """``prefetch_ready`` is the group's answer (a MIN-reduce at end_step): with this
    rank's reads done but the group's answer 'not landed', the request stays held."""
    seams = Seams()
    cache = kvdist.testing.create(_cfg(cfg_factory), seams)
    try:
        d = IntegrityDriver(cache)
        _on_disk(d)
        comm = seams.comm
        reduce = comm.allreduce_min
        answers = []

        def slow_peer(values, what):  # another rank of the TP group has not read them yet
            answers.append(list(values))
            return [*reduce(values, what)[:-1], 0]
        comm.allreduce_min = slow_peer
        d.begin()
        assert cache.prefetch(1, A) == 4
        d.end()
        assert answers[-1][-1] == 1  # this rank has the reads (the simulated stream ran them)
        assert not cache.prefetch_ready(1)
        comm.allreduce_min = reduce
        d.begin()
        d.end()
        assert cache.prefetch_ready(1)
    finally:
        cache.close()


def test_the_main_job_never_makes_a_step_wait_for_a_disk_read(tmp_path, monkeypatch):
    """The main job on simulated streams: every disk read (a prefetch's promotion, a
    reload) runs when an end_step polls for it, never because a step's compute waited
    for it (rule S5 forcing it), and requests did wait for reads. The reads are
    recorded as the simulated disk stream runs them."""
    where = {"in_poll": False}
    reads = {"polled": 0, "forced": 0}
    poll = SimExecutor.poll

    def polling(self, events):
        where["in_poll"] = True
        try:
            return poll(self, events)
        finally:
            where["in_poll"] = False

    def counted(original):
        def run(self, src, dst, vectorized):
            reads["polled" if where["in_poll"] else "forced"] += len(src)
            return original(self, src, dst, vectorized)
        return run
    monkeypatch.setattr(SimExecutor, "poll", polling)
    monkeypatch.setattr(HostCopies, "_promote", counted(HostCopies._promote))
    monkeypatch.setattr(HostCopies, "_reload", counted(HostCopies._reload))
    cfg = sim_cfg(tmp_path, run_ahead=True, wait_for_disk_reads=True)  # the gate (off by default)
    block = cfg.cache.tokens_per_block * 2 * 2 * 2 * 8 * 4  # layers, K|V, heads, dim, float32
    cfg = cfg.replace(cache={"host": {"bytes": 48 * block}, "simulate_async": True})
    sim = solo(cfg, RunOptions(out=None, progress=False))
    try:
        r = sim.run()
        loads = sim.cache.stats()["disk_loads"]
    finally:
        sim.close()
    assert r["ok"] and r["integrity_mismatches"] == 0
    assert r["reused_tokens"]["disk"] == 0 and r["reused_tokens"]["host"] > 0
    assert reads["polled"] > 0 and reads["forced"] == 0, reads
    assert loads["started"] > 0 and loads["waiting"] == 0
