"""Replicas and the remote tier's settings, on one process: the layout arithmetic,
config mistakes (each names its key and values), and the façade of a one-replica job."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import kvdist
from kvdist.distributed.replicas import ReplicaLayout

from .conftest import make_cfg

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("world,tp", [(4, 2), (8, 1), (8, 4), (6, 3), (4, 0), (1, 1)])
def test_layout_of_every_rank(world, tp):
    T = tp or world
    seen = set()
    for rank in range(world):
        where = ReplicaLayout.of(rank, world, tp)
        assert (where.tp_size, where.num_replicas) == (T, world // T)
        assert where.replica == rank // T and where.tp_rank == rank % T
        assert where.world_rank(where.replica, where.tp_rank) == rank
        seen.add((where.replica, where.tp_rank))
    assert len(seen) == world


def test_world_not_a_multiple_of_tp_size_names_key_and_both_numbers():
    with pytest.raises(kvdist.ConfigError) as ei:
        ReplicaLayout.of(0, 6, 4)
    assert ei.value.key == "distributed.tp_size"
    assert "world size 6" in str(ei.value) and "tp_size 4" in str(ei.value)
    with pytest.raises(kvdist.ConfigError, match="distributed.tp_size.*world size 1.*tp_size 2"):
        kvdist.create(make_cfg(distributed={"tp_size": 2}))


@pytest.mark.parametrize("over,key,value", [
    ({"distributed": {"tp_size": -1}}, "distributed.tp_size", "-1"),
    ({"distributed": {"remote": {"fetch_timeout_ms": 0}}}, "distributed.remote.fetch_timeout_ms", "0"),
    ({"distributed": {"remote": {"transport": "pigeons"}}}, "distributed.remote.transport", "pigeons"),
    ({"distributed": {"remote": {"directory_every_steps": 0}}},
     "distributed.remote.directory_every_steps", "0"),
    ({"distributed": {"remote": {"enabled": True}}}, "distributed.remote.enabled", "host tier"),
    ({"distributed": {"remote": {"enabeld": True}}}, "distributed.remote.enabeld", "unknown key"),
])
def test_remote_config_mistakes(over, key, value):
    with pytest.raises(kvdist.ConfigError) as ei:
        kvdist.load_config(make_cfg(**over))
    assert ei.value.key == key and value in str(ei.value)


def test_cli_tp_size_mistake_is_one_line_exit_2(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(make_cfg(distributed={"tp_size": 3})), encoding="utf-8")
    r = subprocess.run([sys.executable, "-m", "kvdist", "run", "--config", str(p)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, encoding="utf-8")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "distributed.tp_size" in lines[0] and "world size 1" in lines[0], r.stderr


def test_one_replica_facade():
    cache = kvdist.create(make_cfg(cache={"host": {"bytes": 4 * 512}}))
    try:
        assert (cache.replica, cache.num_replicas, cache.tp_rank, cache.tp_size) == (0, 1, 0, 1)
        assert "remote" not in cache.tiers
        cache.begin_step()
        assert cache.prefetch("a", list(range(20))) == 0 and cache.prefetch_ready("a")
        assert cache.add_sequence("a", list(range(20))) == 0
        cache.block_table(["a"])
        cache.end_step()
        s = cache.stats()
        assert (s["bytes_fetched_remote"], s["remote_misses"]) == (0, 0)
        assert "remote" not in s["hit_tokens"]
        assert (s["replica"], s["num_replicas"], s["tp_rank"], s["tp_size"]) == (0, 1, 0, 1)
        cache.check_consistency()
    finally:
        cache.close()


def test_shared_host_pool_seen_by_a_peer_mapping_and_fallback(tmp_path):
    """A host pool in a shared file: a second mapping of the file (a peer's view) sees
    the owner's bytes; the name goes at unlink (the mappings stay valid) or at close.
    A file that cannot be had leaves a private pool and the reason."""
    import os

    import torch

    from kvdist.layout import KVLayout
    from kvdist.storage import HostPool

    lay = KVLayout(2, 2, 8, "float16", 4)
    path = str(tmp_path / "pool")
    owner = HostPool(lay, 16, pin=False, shared_path=path, progress=False)
    peer = HostPool(lay, 16, pin=False, shared_path=path, attach=True)
    try:
        assert owner.shared_path == path and owner.shared_error is None
        owner.raw[5] = torch.arange(lay.bytes_per_block, dtype=torch.int64).to(torch.uint8)
        assert torch.equal(peer.raw[5], owner.raw[5])
        owner.memory.unlink()
        assert not os.path.exists(path)
        owner.raw[6].fill_(7)
        assert int(peer.raw[6].sum()) == 7 * lay.bytes_per_block
    finally:
        peer.close()
        owner.close()
    owner = HostPool(lay, 16, pin=False, shared_path=path, progress=False)
    owner.close()
    assert not os.path.exists(path), "close removes the file it created"
    private = HostPool(lay, 16, pin=False, shared_path=str(tmp_path / "no" / "such" / "dir"),
                       progress=False)
    try:
        assert private.shared_path is None and "cannot create" in private.shared_error
        private.raw[0].fill_(1)
    finally:
        private.close()
