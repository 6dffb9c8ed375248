"""A disk tier that exactly fits its disk runs: the space the job's own tier holds
counts as free when the config is checked again while the cache runs, and the main
job's bookkeeping replays (rank 0's alone) never look at the run's disk tier."""

import os
import shutil
import subprocess

import pytest

import kvdist
from kvdist import paths
from kvdist.sim.experiment.shadows import Shadows

from .conftest import make_cfg
from .launching import LAUNCH, ROOT, tiny_config

BLOCK = 2 * 2 * 4 * 2 * 8 * 2  # conftest's BASE: layers * kv * tpb * heads * dim * fp16


@pytest.fixture
def disk_of(monkeypatch):
    """A filesystem of ``nbytes`` free, filled by this process's preallocations only."""
    taken: list[int] = []
    real = os.posix_fallocate

    def fallocate(fd: int, offset: int, length: int) -> None:
        real(fd, offset, length)
        taken.append(length)

    def make(nbytes: int) -> list[int]:
        monkeypatch.setattr(os, "posix_fallocate", fallocate)
        monkeypatch.setattr(paths, "free_bytes", lambda directory: nbytes - sum(taken))
        return taken
    return make


def test_a_tier_that_fills_the_disk_is_still_valid_while_it_runs(tmp_path, disk_of):
    nbytes = 16 * BLOCK
    taken = disk_of(nbytes)
    cfg = kvdist.load_config(make_cfg(cache={"disk": {"path": str(tmp_path), "bytes": nbytes}}))
    with kvdist.create(cfg) as cache:
        assert cache.tiers == ("gpu", "disk") and taken == [nbytes]  # the disk is full now
        again = cfg.replace(workload={"requests": 3})  # checked again: its own file counts as free
        assert again.cache.disk.bytes == nbytes and again.workload.requests == 3
    with pytest.raises(kvdist.ConfigError, match="more than the 0 bytes free") as ei:
        cfg.replace(workload={"requests": 4})  # closed: the space is no longer this job's
    assert ei.value.key == "cache.disk.bytes"


def test_the_replays_never_check_the_runs_disk_tier(tmp_path, disk_of):
    disk_of(16 * BLOCK)
    where = tmp_path / "disk"
    cfg = kvdist.load_config(make_cfg(cache={"disk": {"path": str(where), "bytes": 16 * BLOCK}}))
    with kvdist.create(cfg):
        shutil.rmtree(where)  # the tier's file has no name: the run goes on without its directory
        where.write_text("not a directory any more", encoding="utf-8")
        shadows = Shadows(cfg, gpu_blocks=8, priority=35)  # rank 0's replays, no disk tier of theirs
        assert [r.cache.tiers for r in shadows.replays] == [("gpu",), ("gpu",)]
        shadows.close()


def _can_mount_tmpfs() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                           "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs root and unshare to mount a small tmpfs")
def test_a_two_rank_job_whose_disk_tiers_fill_a_tmpfs_runs_through(tmp_path):
    fs = tmp_path / "fs"
    fs.mkdir()
    cfg = tiny_config(tmp_path, disk_dir=fs, workload={"requests": 30})  # 1 MiB per rank
    job = [*LAUNCH, "-n", "2", "run", "--config", str(cfg), "--quiet", "--out", str(tmp_path / "runs")]
    script = f"mount -t tmpfs -o size=2m tmpfs {fs} && exec {' '.join(job)}"
    env = {**os.environ, "MPIEXEC_TIMEOUT": "120", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=180, encoding="utf-8")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "kvdist run: 2 ranks" in done.stdout, done.stderr
