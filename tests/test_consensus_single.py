"""The start-up protocol on one rank without MPI (same semantics as under mpiexec),
plus its pure parts: fault-drill parsing, capacity MIN, outlier and config-diff
reporting, the cache state digest."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import torch

import kvdist
import kvdist.testing
from kvdist import faults
from kvdist.distributed import capacity as caps
from kvdist.distributed import comm as dist_comm
from kvdist.distributed.consensus import HostTierWarning, config_differences, outliers
from kvdist.testing import Seams
from tests.conftest import make_cfg
from tests.mpi.test_consensus import BLOCK, BUILD_REASON, HOST_REASON, OK_HOST, OK_NO_HOST


@pytest.fixture(autouse=True)
def no_mpi(monkeypatch):
    """A job started without MPI, whatever this test process has imported."""
    monkeypatch.setattr(dist_comm, "mpi_is_running", lambda: False)
    monkeypatch.delenv(faults.ENV, raising=False)


@pytest.fixture
def disk_dir(tmp_path):
    d = tmp_path / "disk"
    d.mkdir()
    return d


def cfg(disk_dir, host_blocks=4, **distributed):
    return make_cfg(cache={"gpu": {"blocks": 8}, "host": {"bytes": host_blocks * BLOCK},
                           "disk": {"path": str(disk_dir), "bytes": 16 * BLOCK}},
                    distributed=distributed)


def assert_clean(probe, disk_dir):
    assert not probe.live, "a built candidate was never torn down"
    assert sum(r() is not None for r in probe.tensors) == 0, "a tier tensor outlived its teardown"
    assert os.listdir(disk_dir) == []


def test_healthy(probe, disk_dir):
    seams = Seams()
    with kvdist.testing.create(cfg(disk_dir), seams) as cache:
        assert isinstance(seams.comm, dist_comm.SingleComm)
        assert (cache.rank, cache.world_size, cache.init_status) == (0, 1, kvdist.InitStatus.KEEP_HOST)
        assert cache.tiers == ("gpu", "host", "disk")
        s = cache.stats()
        assert s["capacity_blocks"] == {"gpu": 8, "host": 4, "disk": 16}
        assert s["init_failures"] == {} and s["init_seconds"]["build"] > 0
        assert s["init_seconds"]["total"] == pytest.approx(sum(
            v for k, v in s["init_seconds"].items() if k != "total"))
    assert probe.builds == [OK_HOST] and probe.teardowns == 1
    assert_clean(probe, disk_dir)


def test_host_tier_fails_rebuilds_without_host(probe, disk_dir, monkeypatch):
    monkeypatch.setenv(faults.ENV, "host_tier@0")
    with pytest.warns(HostTierWarning, match=r"could not be had on rank 0: HostTierUnavailable"):
        cache = kvdist.create(cfg(disk_dir))
    assert cache.init_status == kvdist.InitStatus.USE_NO_HOST and cache.tiers == ("gpu", "disk")
    s = cache.stats()
    assert s["capacity_blocks"] == {"gpu": 8, "disk": 16}
    assert s["init_failures"] == {0: HOST_REASON.format(0)} and s["init_status"] == "USE_NO_HOST"
    cache.close()
    assert probe.builds == [(True, False, "HostTierUnavailable"), OK_NO_HOST]
    assert probe.teardowns == 1  # close(); the failed build freed itself
    assert_clean(probe, disk_dir)


def test_build_error_raises_own_error(probe, disk_dir, monkeypatch):
    monkeypatch.setenv(faults.ENV, "build@0")
    with pytest.raises(kvdist.KVDistError) as e:
        kvdist.create(cfg(disk_dir))
    assert type(e.value) is kvdist.KVDistError
    assert str(e.value) == BUILD_REASON.format("build", 0).removeprefix("KVDistError: ")
    assert e.value.__notes__ == [f"kvdist start-up aborted on all 1 rank(s) (phase 1): "
                                 f"rank 0: {BUILD_REASON.format('build', 0)}"]
    assert probe.builds == [(True, False, "KVDistError")] and probe.teardowns == 0
    assert set(e.value.init_seconds) == {"plan", "build", "teardown", "consensus", "total"}
    assert_clean(probe, disk_dir)


def test_rebuild_without_host_fails(probe, disk_dir, monkeypatch):
    monkeypatch.setenv(faults.ENV, "host_tier@0,fallback_build@0")
    with pytest.warns(HostTierWarning), pytest.raises(kvdist.KVDistError, match="fallback_build failed"):
        kvdist.create(cfg(disk_dir))
    assert probe.builds == [(True, False, "HostTierUnavailable"), (False, True, "KVDistError")]
    assert probe.teardowns == 0
    assert_clean(probe, disk_dir)


def test_plan_error_aborts_without_building(probe, disk_dir):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA (cuda:0 must be unavailable)")
    bad = cfg(disk_dir)
    bad["cache"]["device"] = "cuda:0"
    with pytest.raises(kvdist.ConfigError, match="cache.device"):
        kvdist.create(bad)
    assert probe.builds == []
    assert_clean(probe, disk_dir)


def test_stall_times_out_and_tears_down(probe, disk_dir, monkeypatch):
    monkeypatch.setenv(faults.ENV, "stall@0")
    t0 = time.monotonic()
    with pytest.raises(kvdist.ConsensusTimeout, match="rank 0 stalled"):
        kvdist.create(cfg(disk_dir, consensus_timeout_s=0.2))
    assert time.monotonic() - t0 >= faults.stall_seconds(0.2)
    assert probe.builds == [OK_HOST] and probe.teardowns == 1
    assert_clean(probe, disk_dir)


def test_collective_error_tears_candidate_down(probe, disk_dir, monkeypatch):
    def broken(self, value, what):
        raise RuntimeError(f"injected failure of '{what}'")

    monkeypatch.setattr(dist_comm.SingleComm, "allreduce_max", broken)
    with pytest.raises(RuntimeError, match="phase 1: status"):
        kvdist.create(cfg(disk_dir))
    assert probe.builds == [OK_HOST] and probe.teardowns == 1
    assert_clean(probe, disk_dir)


def test_no_mpi_job_never_imports_mpi(tmp_path):
    """A plain ``python`` process (no launcher) runs the protocol without mpi4py."""
    script = (
        "import sys, warnings, kvdist\n"
        "from tests.conftest import make_cfg\n"
        "warnings.simplefilter('ignore')\n"
        "c = kvdist.create(make_cfg(cache={'host': {'bytes': 2048}}))\n"
        "print(c.init_status.name, c.tiers, 'mpi4py.MPI' in sys.modules)\n"
        "c.close()\n")
    env = {k: v for k, v in os.environ.items()
           if k not in dist_comm._LAUNCHER_VARS and not k.startswith(("PMI", "PMIX", "OMPI", "HYDI", "MPI"))}
    env[faults.ENV] = "host_tier@0"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True,
                         text=True, timeout=120, encoding="utf-8")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "USE_NO_HOST ('gpu',) False"


def test_check_consistency_single_rank_and_digest(disk_dir):
    """Caches fed the same stream have equal state digests; a different stream differs."""
    def run(tokens):
        cache = kvdist.create(cfg(disk_dir, host_blocks=2))
        cache.begin_step()
        cache.add_sequence("s", tokens)
        cache.block_table(["s"])
        cache.end_step()
        cache.release("s")
        cache.check_consistency()
        digest = cache.state_digest()
        cache.close()
        return digest

    a, b, c = run(list(range(12))), run(list(range(12))), run(list(range(1, 13)))
    assert a == b and a != c and len(a) == 16


def test_fault_spec_parsing():
    assert faults.parse("host_tier@1, build@2,host_tier@3") == {"host_tier": {1, 3}, "build": {2}}
    assert faults.parse("stall@*,stall@2") == {"stall": None}
    assert faults.active("build", 7, "build@*") and not faults.active("build", 7, "build@1")
    for bad in ("nope@1", "build", "build@x"):
        with pytest.raises(kvdist.ConfigError, match=faults.ENV):
            faults.parse(bad)
    with pytest.raises(AssertionError):
        faults.inject("stall", 0)


def test_fake_ranks_per_node_env(monkeypatch):
    monkeypatch.setenv(dist_comm.FAKE_RANKS_PER_NODE_ENV, "2")
    assert dist_comm.fake_ranks_per_node() == 2
    for bad in ("0", "-1", "two"):
        monkeypatch.setenv(dist_comm.FAKE_RANKS_PER_NODE_ENV, bad)
        with pytest.raises(kvdist.ConfigError, match=dist_comm.FAKE_RANKS_PER_NODE_ENV):
            dist_comm.fake_ranks_per_node()
    monkeypatch.delenv(dist_comm.FAKE_RANKS_PER_NODE_ENV)
    assert dist_comm.fake_ranks_per_node() is None
    assert dist_comm.node_info() == dist_comm.NodeInfo(0, 1, 0, 1)


def test_min_capacity():
    rows = np.array([caps.encode((24, 8, 64)), caps.encode(None), caps.encode((30, 4, 70))])
    assert caps.min_capacity(rows) == (24, 4, 64)
    assert caps.min_capacity(np.array([caps.encode(None)] * 2)) is None
    assert caps.describe([(24, 8, 64), None, (30, 4, 70)], (24, 4, 64)) == \
        "rank 0: host 8->4; rank 2: gpu 30->24, disk 70->64"


def test_outliers_and_config_differences():
    assert outliers(["a", "b", "a", "a"]) == (0, [1])
    assert outliers(["b", "a", "a"]) == (1, [0])
    assert outliers(["a", "b"]) == (0, [1])  # a tie goes to the lowest rank's value
    assert outliers(["a", "b", "c"]) == (0, [1, 2])
    base = kvdist.load_config(make_cfg()).normalized()
    other = kvdist.load_config(make_cfg(cache={"gpu": {"blocks": 16}},
                                        model={"head_dim": 4})).normalized()
    assert config_differences(other, base) == ["cache.gpu.blocks=16 (reference 8)",
                                               "model.head_dim=4 (reference 8)"]


def test_warning_names_the_caller(disk_dir, monkeypatch):
    monkeypatch.setenv(faults.ENV, "host_tier@0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kvdist.create(cfg(disk_dir)).close()
    [w] = [w for w in caught if issubclass(w.category, HostTierWarning)]
    assert w.filename == __file__
