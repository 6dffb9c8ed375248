"""The start-up consensus under mpiexec (docs/design.md, "Start-up"): every fault drill, every rank's
outcome, how often each rank built and tore down a candidate, committed tiers and
capacities identical everywhere, nothing left in memory or on disk.

Written for ``mpiexec -n 4`` and valid at any world size: faults name rank 0 and the
last rank, and the expectations are computed from the world size."""

from __future__ import annotations

import os
import time
import warnings

import numpy as np
import pytest

import kvdist
import kvdist.candidate
from kvdist import faults
from kvdist.distributed import capacity as caps
from kvdist.distributed import comm as dist_comm
from kvdist.distributed.consensus import HostTierWarning
from tests.conftest import Probe, make_cfg
from tests.test_integrity import churn

pytestmark = pytest.mark.mpi

BLOCK = 512  # bytes per block of tests.conftest.BASE
HOST_REASON = "HostTierUnavailable: fault drill KVDIST_FAULTS: host tier unavailable on rank {}"
BUILD_REASON = "KVDistError: fault drill KVDIST_FAULTS: {} failed on rank {}"


@pytest.fixture
def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


@pytest.fixture
def shared_dir(tmp_path_factory, world):
    """One disk-tier directory for all ranks (rank 0's tmp dir)."""
    path = world.bcast(str(tmp_path_factory.mktemp("disk")) if world.rank == 0 else None)
    yield path
    world.Barrier()


def config(shared_dir: str, host_blocks: int = 4, timeout: float = 30.0, gpu: int = 8) -> dict:
    return make_cfg(
        cache={"gpu": {"blocks": gpu}, "host": {"bytes": host_blocks * BLOCK},
               "disk": {"path": shared_dir, "bytes": 16 * BLOCK}},
        distributed={"consensus_timeout_s": timeout})


def attempt(world, monkeypatch, probe: Probe, cfg: dict, drill: str = "", shared_dir: str = "") -> list[dict]:
    """Every rank runs create() (then close() on success); returns every rank's outcome."""
    monkeypatch.setenv(faults.ENV, drill)
    out: dict = {"rank": world.rank}
    closed = None  # a closed cache the caller still holds must not keep any tier alive
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            cache = kvdist.create(cfg)
        except Exception as e:
            out.update(kind=type(e).__name__, message=str(e), failures=getattr(e, "failures", None),
                       notes=list(getattr(e, "__notes__", [])))
        else:
            s = cache.stats()
            out.update(kind="ok", status=cache.init_status, tiers=cache.tiers,
                       capacity=s["capacity_blocks"], init_failures=s["init_failures"],
                       init_seconds=s["init_seconds"])
            cache.close()
            closed = cache
    out["seconds"] = time.monotonic() - t0
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, HostTierWarning)]
    out["builds"], out["teardowns"] = probe.builds, probe.teardowns
    out["not_torn_down"] = len(probe.live)
    out["alive_tensors"] = sum(r() is not None for r in probe.tensors)
    out["files_left"] = [f for f in probe.files if os.path.exists(f)]
    del closed
    world.Barrier()
    if shared_dir:
        out["dir_left"] = os.listdir(shared_dir)
    return world.allgather(out)


def assert_clean(outcomes: list[dict]) -> None:
    """Every built candidate was torn down and freed; no file is left."""
    for o in outcomes:
        assert o["not_torn_down"] == 0 and o["alive_tensors"] == 0, o
        assert o["files_left"] == [] and o.get("dir_left", []) == [], o


def assert_committed(outcomes: list[dict], status, tiers, capacity) -> None:
    for o in outcomes:
        assert o["kind"] == "ok", o
        assert (o["status"], o["tiers"], o["capacity"]) == (status, tiers, capacity), o


OK_HOST = (True, False, "ok")
OK_NO_HOST = (False, True, "ok")


def test_all_healthy(world, monkeypatch, probe, shared_dir):
    outcomes = attempt(world, monkeypatch, probe, config(shared_dir), shared_dir=shared_dir)
    assert_committed(outcomes, kvdist.InitStatus.KEEP_HOST, ("gpu", "host", "disk"),
                     {"gpu": 8, "host": 4, "disk": 16})
    for o in outcomes:
        assert o["builds"] == [OK_HOST] and o["teardowns"] == 1, o  # the teardown is close()
        assert o["warnings"] == [] and o["init_failures"] == {}, o
        t = o["init_seconds"]
        assert set(t) == {"plan", "build", "teardown", "consensus", "total"} and t["build"] > 0, t
    assert_clean(outcomes)


def _host_fault_sets(n: int) -> dict[str, set[int]]:
    return {"one": {n - 1}, "two": {0, n - 1}, "all": set(range(n))}


@pytest.mark.parametrize("which", ["one", "two", "all"])
def test_host_tier_fails(world, monkeypatch, probe, shared_dir, which):
    failing = _host_fault_sets(world.size)[which]
    drill = "host_tier@*" if which == "all" else ",".join(f"host_tier@{r}" for r in sorted(failing))
    outcomes = attempt(world, monkeypatch, probe, config(shared_dir), drill, shared_dir)
    assert_committed(outcomes, kvdist.InitStatus.USE_NO_HOST, ("gpu", "disk"),
                     {"gpu": 8, "disk": 16})
    expected_failures = {r: HOST_REASON.format(r) for r in failing}
    for o in outcomes:
        mine = o["rank"] in failing
        first = (True, False, "HostTierUnavailable") if mine else OK_HOST
        assert o["builds"] == [first, OK_NO_HOST], o
        # the healthy first candidate (if any) when USE_NO_HOST was agreed, then close()
        assert o["teardowns"] == (1 if mine else 2), o
        assert o["init_failures"] == expected_failures, o
        assert len(o["warnings"]) == 1, o
        for r in failing:
            assert f"rank {r}: {HOST_REASON.format(r)}" in o["warnings"][0], o
    assert_clean(outcomes)


def _assert_aborted(outcomes: list[dict], own: dict[int, tuple[str, str]], failures: dict[int, str]):
    """Ranks in ``own`` raise their own error (type, message); the others ConsensusAbort
    with exactly ``failures``, named in the message."""
    for o in outcomes:
        if o["rank"] in own:
            kind, message = own[o["rank"]]
            assert (o["kind"], o["message"]) == (kind, message), o
            assert any(f"rank {r}: " in n for n in o["notes"] for r in failures), o
        else:
            assert o["kind"] == "ConsensusAbort" and o["failures"] == failures, o
            for r, why in failures.items():
                assert f"rank {r}: {why}" in o["message"], o


def test_build_error_on_one_rank(world, monkeypatch, probe, shared_dir):
    bad = world.size - 1
    outcomes = attempt(world, monkeypatch, probe, config(shared_dir), f"build@{bad}", shared_dir)
    why = BUILD_REASON.format("build", bad)
    _assert_aborted(outcomes, {bad: ("KVDistError", why.removeprefix("KVDistError: "))}, {bad: why})
    for o in outcomes:
        mine = o["rank"] == bad
        assert o["builds"] == [(True, False, "KVDistError") if mine else OK_HOST], o
        assert o["teardowns"] == (0 if mine else 1), o
    assert_clean(outcomes)


def test_build_error_without_host_tier(world, monkeypatch, probe, shared_dir):
    """No host tier configured: the protocol still runs, so no peer hangs or commits alone."""
    bad = world.size - 1
    cfg = config(shared_dir, host_blocks=0)
    outcomes = attempt(world, monkeypatch, probe, cfg, f"build@{bad}", shared_dir)
    why = BUILD_REASON.format("build", bad)
    _assert_aborted(outcomes, {bad: ("KVDistError", why.removeprefix("KVDistError: "))}, {bad: why})
    for o in outcomes:
        assert o["builds"] == [(True, False, "KVDistError") if o["rank"] == bad else OK_HOST], o
        assert o["teardowns"] == (0 if o["rank"] == bad else 1), o
    assert_clean(outcomes)
    # The same config without a fault commits without a host tier.
    probe.builds.clear()
    probe.teardowns = 0
    outcomes = attempt(world, monkeypatch, probe, cfg, "", shared_dir)
    assert_committed(outcomes, kvdist.InitStatus.KEEP_HOST, ("gpu", "disk"), {"gpu": 8, "disk": 16})
    assert_clean(outcomes)


def test_host_fails_then_rebuild_fails(world, monkeypatch, probe, shared_dir):
    """Host tier fails on rank 0, the rebuild without it on the last rank: ABORT in phase 2."""
    bad = world.size - 1
    drill = f"host_tier@0,fallback_build@{bad}"
    outcomes = attempt(world, monkeypatch, probe, config(shared_dir), drill, shared_dir)
    rebuild = BUILD_REASON.format("fallback_build", bad)
    failures = {bad: f"rebuild without the host tier: {rebuild}"}
    if bad != 0:
        failures[0] = HOST_REASON.format(0)
    else:
        failures[0] += f" (after {HOST_REASON.format(0)})"
    _assert_aborted(outcomes, {bad: ("KVDistError", rebuild.removeprefix("KVDistError: "))}, failures)
    for o in outcomes:
        r = o["rank"]
        first = (True, False, "HostTierUnavailable") if r == 0 else OK_HOST
        second = (False, True, "KVDistError") if r == bad else OK_NO_HOST
        assert o["builds"] == [first, second], o
        assert o["teardowns"] == (r != 0) + (r != bad), o
        assert len(o["warnings"]) == 1 and HOST_REASON.format(0) in o["warnings"][0], o
    assert_clean(outcomes)


def test_stalled_rank_times_out_the_others(world, monkeypatch, probe, shared_dir):
    timeout = 3.0
    stalled = world.size - 1
    cfg = config(shared_dir, timeout=timeout)
    outcomes = attempt(world, monkeypatch, probe, cfg, f"stall@{stalled}", shared_dir)
    for o in outcomes:
        assert o["kind"] == "ConsensusTimeout", o
        assert o["builds"] == [OK_HOST] and o["teardowns"] == 1, o  # the candidate is torn down
        if o["rank"] == stalled:
            assert "stalled" in o["message"], o
            assert o["seconds"] >= faults.stall_seconds(timeout), o
        else:
            assert "phase 1: status" in o["message"], o
            assert timeout <= o["seconds"] < timeout + 4.0, o
    assert_clean(outcomes)


def test_configs_differ_on_one_rank(world, monkeypatch, probe, shared_dir):
    odd = world.size - 1
    cfg = config(shared_dir, gpu=16 if world.rank == odd and world.size > 1 else 8)
    outcomes = attempt(world, monkeypatch, probe, cfg, "", shared_dir)
    if world.size == 1:
        assert_committed(outcomes, kvdist.InitStatus.KEEP_HOST, ("gpu", "host", "disk"),
                         {"gpu": 8, "host": 4, "disk": 16})
    else:
        why = "config differs from rank 0's: cache.gpu.blocks=16 (reference 8)"
        for o in outcomes:
            assert (o["kind"], o["failures"]) == ("ConsensusAbort", {odd: why}), o
            assert f"differ on rank(s) {odd}" in o["message"] and f"rank {odd}: {why}" in o["message"], o
            assert o["builds"] == [] and o["teardowns"] == 0, o
    assert_clean(outcomes)


class InjectedMpiError(RuntimeError):
    pass


@pytest.mark.parametrize("phase", ["phase 1", "phase 2"])
def test_collective_raises_after_local_build(world, monkeypatch, probe, shared_dir, phase):
    """The status collective completes, then reports an error on every rank: each rank
    tears its candidate down before the error propagates."""
    for cls in (dist_comm.MpiComm, dist_comm.SingleComm):
        real = cls.allreduce_max

        def failing(self, value, what, real=real):
            result = real(self, value, what)
            if what.startswith(phase):
                raise InjectedMpiError(f"injected failure of '{what}'")
            return result

        monkeypatch.setattr(cls, "allreduce_max", failing)
    drill = "host_tier@0" if phase == "phase 2" else ""
    outcomes = attempt(world, monkeypatch, probe, config(shared_dir), drill, shared_dir)
    for o in outcomes:
        assert o["kind"] == "InjectedMpiError" and phase in o["message"], o
        if phase == "phase 1":
            assert o["builds"] == [OK_HOST] and o["teardowns"] == 1, o
        else:
            first = (True, False, "HostTierUnavailable") if o["rank"] == 0 else OK_HOST
            assert o["builds"] == [first, OK_NO_HOST], o
            assert o["teardowns"] == (1 if o["rank"] == 0 else 2), o
    assert_clean(outcomes)


def _rank_dependent_plans(monkeypatch, rank: int) -> None:
    monkeypatch.setattr(kvdist.candidate.CandidateBuilder, "plan",
                        lambda self: (setattr(self, "device", kvdist.select_device("cpu"))
                                      or (24 + 3 * rank, 8 + rank, 64 + 5 * rank)))


def _min_off(monkeypatch, rank: int) -> None:
    """The rule switched off: every rank keeps its own plan."""
    monkeypatch.setattr(caps, "min_capacity", lambda rows: tuple(int(n) for n in rows[rank]))


@pytest.mark.parametrize("rule", ["on", "off"])
def test_capacities_are_min_reduced(world, monkeypatch, shared_dir, rule):
    """Ranks that plan different capacities commit the MIN, and then make identical
    decisions for one request stream; with the MIN switched off they diverge, and
    check_consistency names the diverged ranks (the rule-off case)."""
    if rule == "off" and world.size == 1:
        pytest.skip("one rank cannot diverge")
    _rank_dependent_plans(monkeypatch, world.rank)
    if rule == "off":
        _min_off(monkeypatch, world.rank)
    cache = kvdist.create(config(shared_dir))
    try:
        caps = world.allgather(cache.stats()["capacity_blocks"])
        churn(cache, steps=60, seed=7, check=False)
        s = cache.stats()
        decisions = world.allgather((s["hit_tokens"], s["blocks_moved"], s["evictions"], s["dropped"]))
        if rule == "on":
            assert caps == [{"gpu": 24, "host": 8, "disk": 64}] * world.size, caps
            assert all(d == decisions[0] for d in decisions), decisions
            cache.check_consistency()
        else:
            assert [c["gpu"] for c in caps] == [24 + 3 * r for r in range(world.size)], caps
            assert any(d != decisions[0] for d in decisions), decisions
            with pytest.raises(kvdist.ConsistencyError) as e:
                cache.check_consistency()
            assert e.value.diverged == list(range(1, world.size)), e.value
    finally:
        cache.close()


def _step(cache, seq_id, tokens):
    cache.begin_step()
    cache.add_sequence(seq_id, tokens)
    cache.block_table([seq_id])
    cache.end_step()
    cache.release(seq_id)


def test_check_consistency_names_diverged_rank(world, shared_dir):
    cache = kvdist.create(config(shared_dir))
    odd = world.size - 1
    try:
        _step(cache, "a", list(range(10)))
        digest = cache.state_digest()
        cache.check_consistency()
        assert len(set(world.allgather(digest))) == 1
        _step(cache, "b", list(range(6, 16)) if world.rank == odd else list(range(5, 15)))
        if world.size == 1:
            cache.check_consistency()
        else:
            with pytest.raises(kvdist.ConsistencyError) as e:
                cache.check_consistency()
            assert e.value.diverged == [odd] and f"rank(s) {odd} differ from rank 0" in str(e.value)
    finally:
        cache.close()


def test_check_consistency_every_n_steps(world, shared_dir):
    cfg = make_cfg(cache={"gpu": {"blocks": 8}}, distributed={"check_consistency_every": 2})
    cache = kvdist.create(cfg)
    odd = world.size - 1
    try:
        _step(cache, 0, list(range(9)))
        _step(cache, 1, list(range(9)))  # step 2: checked, consistent
        assert cache.stats()["consistency_checks"] == 1
        _step(cache, 2, list(range(world.rank == odd, 9)))  # step 3 diverges, not checked
        if world.size == 1:
            _step(cache, 3, [1, 2, 3])
            assert cache.stats()["consistency_checks"] == 2
        else:
            with pytest.raises(kvdist.ConsistencyError) as e:
                _step(cache, 3, [1, 2, 3])  # step 4: checked at end_step
            assert e.value.diverged == [odd]
    finally:
        cache.close()


def test_comm_timeout_then_unusable(world):
    """A rank that skips a collective: the others time out, and their communicator
    refuses every later collective instead of matching the wrong operation."""
    c = dist_comm.resolve(world, timeout_s=1.0)
    late = world.size - 1
    try:
        if world.rank != late:
            t0 = time.monotonic()
            with pytest.raises(kvdist.ConsensusTimeout, match="'skipped'"):
                c.barrier("skipped")
            assert 1.0 <= time.monotonic() - t0 < 3.0
            with pytest.raises(kvdist.ConsensusTimeout, match="unusable since collective 'skipped'"):
                c.allreduce_max(1, "next")
        elif world.size == 1:
            c.barrier("skipped")
    finally:
        c.free()
    world.Barrier()


@pytest.mark.parametrize("per_node", [None, 2])
def test_node_layout(world, monkeypatch, per_node):
    if per_node is None:
        monkeypatch.delenv(dist_comm.FAKE_RANKS_PER_NODE_ENV, raising=False)
    else:
        monkeypatch.setenv(dist_comm.FAKE_RANKS_PER_NODE_ENV, str(per_node))
    info = dist_comm.node_info(world)
    r, n = world.rank, world.size
    if per_node is None:  # mpiexec on this one machine
        assert info == dist_comm.NodeInfo(r, n, 0, 1)
    else:
        first = r - r % per_node
        assert info == dist_comm.NodeInfo(r % per_node, min(per_node, n - first), r // per_node,
                                          -(-n // per_node))


def test_allgather_objects(world):
    c = dist_comm.resolve(world)
    try:
        mine = {"rank": world.rank, "blob": "x" * (world.rank * 1000)}
        assert c.allgather(mine, "objects") == [{"rank": r, "blob": "x" * (r * 1000)}
                                                for r in range(world.size)]
        got = c.allgather_ints([world.rank, -world.rank], "ints")
        assert np.array_equal(got, np.array([[r, -r] for r in range(world.size)]))
        assert c.allreduce_min([world.rank + 3, 7 - world.rank], "min") == [3, 7 - (world.size - 1)]
    finally:
        c.free()


def test_teardown_error_during_use_no_host(world, monkeypatch, probe, shared_dir):
    """The host tier fails on rank 0; tearing down the healthy candidate fails on the last
    rank. That rank must still reach phase 2 (no hang) and, rather than stacking a second
    candidate on memory it may still hold, report ABORT with its teardown error."""
    if world.size == 1:
        pytest.skip("needs a healthy candidate on a rank other than the host-failing one")
    last = world.size - 1
    counted_teardown = kvdist.candidate.RankCache.teardown
    failed = []

    def teardown(self):
        counted_teardown(self)
        if world.rank == last and not failed:
            failed.append(True)
            raise RuntimeError("injected teardown failure")

    monkeypatch.setattr(kvdist.candidate.RankCache, "teardown", teardown)
    outcomes = attempt(world, monkeypatch, probe, config(shared_dir), "host_tier@0", shared_dir)
    failures = {0: HOST_REASON.format(0),
                last: "rebuild without the host tier: RuntimeError: injected teardown failure"}
    _assert_aborted(outcomes, {last: ("RuntimeError", "injected teardown failure")}, failures)
    for o in outcomes:
        r = o["rank"]
        first = (True, False, "HostTierUnavailable") if r == 0 else OK_HOST
        assert o["builds"] == ([first] if r == last else [first, OK_NO_HOST]), o
        assert o["teardowns"] == (r != 0) + (r != last), o
    assert_clean(outcomes)
