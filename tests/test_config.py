import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import kvdist
from kvdist.units import parse_size

from .conftest import make_cfg

ROOT = Path(__file__).resolve().parents[1]


def test_default_config_loads():
    cfg = kvdist.load_config(ROOT / "configs" / "default.yaml")
    assert isinstance(cfg, kvdist.CacheConfig)
    assert cfg.cache.tokens_per_block == 16
    assert kvdist.load_config(cfg) is cfg


@pytest.mark.parametrize("text,expected", [
    (4096, 4096), ("4096", 4096), ("64MiB", 64 << 20), ("2GiB", 2 << 30), ("2 GB", 2 * 10**9),
    ("1.5KiB", 1536), ("10KB", 10_000), (0, 0),
])
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["1" + "0" * 400, "1" + "0" * 400 + "KiB", 10**400, 1 << 63],
                         ids=["400 digits", "400 digits KiB", "int of 401 digits", "2**63"])
def test_a_size_past_int64_is_a_config_error_not_an_overflow(text):
    with pytest.raises(kvdist.ConfigError, match="a size is at most 9,223,372,036,854,775,807 bytes") as ei:
        kvdist.load_config(make_cfg(cache={"host": {"bytes": text}}))
    assert ei.value.key == "cache.host.bytes"


def test_dict_and_yaml_agree(tmp_path):
    d = make_cfg(cache={"host": {"bytes": "1MiB"}})
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(d), encoding="utf-8")
    assert kvdist.load_config(p) == kvdist.load_config(d)
    assert kvdist.load_config(p).cache.host.bytes == 1 << 20
    assert kvdist.load_config(p).digest() == kvdist.load_config(d).digest()


BAD = [
    ("unknown top key", {"cachee": {}}, "cachee", "unknown key"),
    ("unknown nested key", {"cache": {"gpu": {"blocks": 8, "blokcs": 3}}}, "cache.gpu.blokcs", "unknown key"),
    ("wrong type", {"model": {"num_layers": "two"}}, "model.num_layers", "'two'"),
    ("bool is no int", {"model": {"head_dim": True}}, "model.head_dim", "True"),
    ("zero blocks", {"cache": {"gpu": {"blocks": 0}}}, "cache.gpu.blocks", "0"),
    ("negative size", {"cache": {"host": {"bytes": -5}}}, "cache.host.bytes", "-5"),
    ("zero gpu bytes", {"cache": {"gpu": {"bytes": 0}}}, "cache.gpu.bytes", "0"),
    ("bad unit", {"cache": {"host": {"bytes": "3 parsecs"}}}, "cache.host.bytes", "3 parsecs"),
    ("fraction > 1", {"cache": {"gpu": {"memory_fraction": 1.5}}}, "cache.gpu.memory_fraction", "1.5"),
    ("fraction 0", {"cache": {"gpu": {"memory_fraction": 0}}}, "cache.gpu.memory_fraction", "0"),
    ("tpb not pow2", {"cache": {"tokens_per_block": 12}}, "cache.tokens_per_block", "12"),
    ("unknown dtype", {"model": {"dtype": "float13"}}, "model.dtype", "float13"),
    ("unknown device", {"cache": {"device": "tpu:0"}}, "cache.device", "tpu:0"),
    ("priority range", {"cache": {"offload_min_priority": 101}}, "cache.offload_min_priority", "101"),
    ("timeout", {"distributed": {"consensus_timeout_s": 0}}, "distributed.consensus_timeout_s", "0"),
    ("endless timeout", {"distributed": {"consensus_timeout_s": float("inf")}},
     "distributed.consensus_timeout_s", "inf"),
    ("negative seed", {"workload": {"seed": -1}}, "workload.seed", "-1"),
    ("seed past int64", {"workload": {"seed": 1 << 63}}, "workload.seed", str(1 << 63)),
    ("rate of nan", {"workload": {"arrival_rate": float("nan")}}, "workload.arrival_rate", "nan"),
    ("rate of idle steps", {"workload": {"arrival_rate": 1e-4}}, "workload.arrival_rate", "0.0001"),
]


@pytest.mark.parametrize("name,over,key,value", BAD, ids=[b[0] for b in BAD])
def test_bad_values_name_key_and_value(name, over, key, value):
    with pytest.raises(kvdist.ConfigError) as ei:
        kvdist.load_config(make_cfg(**over))
    assert ei.value.key == key
    assert f"'{key}'" in str(ei.value) and value in str(ei.value)
    assert isinstance(ei.value, ValueError)


def test_two_gpu_sizes_rejected():
    with pytest.raises(kvdist.ConfigError, match="cache.gpu.*exactly one"):
        kvdist.load_config(make_cfg(cache={"gpu": {"blocks": 8, "bytes": "1MiB"}}))


def test_missing_required_key():
    d = make_cfg()
    del d["model"]["head_dim"]
    with pytest.raises(kvdist.ConfigError, match="'model.head_dim': missing required key"):
        kvdist.load_config(d)


def test_disk_path_that_cannot_be_created(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x", encoding="utf-8")
    with pytest.raises(kvdist.ConfigError) as ei:
        kvdist.load_config(make_cfg(cache={"disk": {"bytes": "1MiB", "path": str(blocker / "sub")}}))
    assert ei.value.key == "cache.disk.path" and str(blocker / "sub") in str(ei.value)


def test_tier_smaller_than_a_block_names_key():
    with pytest.raises(kvdist.ConfigError, match="cache.host.bytes.*smaller than one block"):
        kvdist.create(make_cfg(cache={"host": {"bytes": 100}}))


def test_cuda_device_without_cuda():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(kvdist.ConfigError, match="cache.device"):
        kvdist.create(make_cfg(cache={"device": "cuda:0"}))


def _cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "kvdist", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, encoding="utf-8")


def _cli_mistake(tmp_path, cfg: dict, key: str, value: str):
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    r = _cli("run", "--config", str(p))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0] and value in lines[0], r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("name,over,key,value", BAD, ids=[b[0] for b in BAD])
def test_cli_config_mistake_is_one_line_exit_2(tmp_path, name, over, key, value):
    _cli_mistake(tmp_path, make_cfg(**over), key, value)


def test_cli_missing_key_two_gpu_sizes_and_bad_disk_path(tmp_path):
    cfg = make_cfg()
    del cfg["model"]["head_dim"]
    _cli_mistake(tmp_path, cfg, "model.head_dim", "missing required key")
    _cli_mistake(tmp_path, make_cfg(cache={"gpu": {"blocks": 8, "bytes": "1MiB"}}), "cache.gpu",
                 "exactly one")
    blocker = tmp_path / "file"
    blocker.write_text("x", encoding="utf-8")
    bad = str(blocker / "sub")
    _cli_mistake(tmp_path, make_cfg(cache={"disk": {"bytes": "1MiB", "path": bad}}), "cache.disk.path", bad)


def test_cli_missing_file_and_bad_yaml(tmp_path):
    r = _cli("run", "--config", str(tmp_path / "nope.yaml"))
    assert r.returncode == 2 and "nope.yaml" in r.stderr and "Traceback" not in r.stderr
    p = tmp_path / "broken.yaml"
    p.write_text("model: [unclosed\n", encoding="utf-8")
    r = _cli("run", "--config", str(p))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "YAML" in r.stderr


def test_workload_check_consistency_every_is_read_as_the_distributed_key():
    """Deprecated, still read: the main job's own key became the cache's one
    (distributed.check_consistency_every); both with different values is a mistake."""
    with pytest.warns(FutureWarning, match="workload.check_consistency_every is deprecated"):
        cfg = kvdist.load_config(make_cfg(workload={"check_consistency_every": 7}))
    assert cfg.distributed.check_consistency_every == 7
    assert "check_consistency_every" not in cfg.normalized()["workload"]
    with pytest.warns(FutureWarning):
        same = kvdist.load_config(make_cfg(workload={"check_consistency_every": 7},
                                           distributed={"check_consistency_every": 7}))
    assert same == cfg
    with pytest.raises(kvdist.ConfigError, match=r"workload.check_consistency_every.*give only "
                                                 r"distributed.check_consistency_every"):
        kvdist.load_config(make_cfg(workload={"check_consistency_every": 7},
                                    distributed={"check_consistency_every": 5}))
