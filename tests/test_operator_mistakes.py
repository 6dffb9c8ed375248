"""Every operator mistake is one line naming the key (or option) and the value, exit
status 2, printed once however many ranks run, and found before anything is built or
created."""

import os
import socket

import pytest
import yaml

import kvdist

from .conftest import make_cfg
from .launching import finish, start, tiny_config


def _one_line(args: list[str], must: list[str], np: int | None = None, env: dict | None = None) -> str:
    code, out, err = finish(start(args, np=np, env=env), timeout=120)
    lines = [ln for ln in err.splitlines() if not ln.startswith("kvdist-launch:")]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("kvdist: "), err
    assert all(m in lines[0] for m in must), err
    assert "Traceback" not in err and "kvdist run:" not in out  # nothing was built
    return lines[0]


def _config(tmp_path, **sections) -> str:
    cfg = yaml.safe_load(tiny_config(tmp_path).read_text(encoding="utf-8"))
    for name, over in sections.items():
        cfg[name].update(over)  # a key's whole value is replaced
    path = tmp_path / "mistake.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return str(path)


def test_binary_config_file_is_one_line_once_on_4_ranks(tmp_path):
    path = tmp_path / "garbage.yaml"
    path.write_bytes(bytes(range(256)) * 4)
    _one_line(["run", "--config", str(path)], ["not UTF-8", str(path)], np=4)


@pytest.mark.parametrize("gpu, key", [({"blocks": 10**12}, "cache.gpu.blocks"),
                                      ({"bytes": "10000TB"}, "cache.gpu.bytes")])
def test_gpu_tier_larger_than_memory_names_the_key(gpu, key):
    cfg = make_cfg()
    cfg["cache"]["gpu"] = gpu
    with pytest.raises(kvdist.ConfigError, match="more than the .* bytes this node has available") as ei:
        kvdist.create(cfg)
    assert ei.value.key == key  # before any allocation (no torch allocator error)


def test_gpu_tier_mistake_is_printed_once_on_4_ranks(tmp_path):
    _one_line(["run", "--config", _config(tmp_path, cache={"gpu": {"blocks": 10**12}})],
              ["cache.gpu.blocks", "1000000000000"], np=4)


def test_disk_bytes_beyond_the_free_space(tmp_path):
    cfg = make_cfg(cache={"disk": {"path": str(tmp_path / "a" / "b"), "bytes": "10000TB"}})
    with pytest.raises(kvdist.ConfigError, match="more than the .* bytes free") as ei:
        kvdist.load_config(cfg)
    assert ei.value.key == "cache.disk.bytes" and not (tmp_path / "a").exists()


@pytest.mark.parametrize("where", ["/proc", "/sys/kernel"])
def test_disk_path_on_a_pseudo_filesystem_is_not_writable(where):
    if not os.path.isdir(where):
        pytest.skip(f"no {where} here")
    with pytest.raises(kvdist.ConfigError, match=f"{where} is not writable") as ei:
        kvdist.load_config(make_cfg(cache={"disk": {"path": where, "bytes": "1MiB"}}))
    assert ei.value.key == "cache.disk.path" and "too full" not in str(ei.value)


def test_nothing_is_created_before_the_whole_config_validated(tmp_path):
    disk = {"disk": {"path": str(tmp_path / "a/b/c"), "bytes": "1MiB"}}
    bad = make_cfg(model={"num_layers": 0}, cache=disk)
    with pytest.raises(kvdist.ConfigError, match="model.num_layers"):
        kvdist.load_config(bad)
    good = make_cfg(cache=disk)
    kvdist.load_config(good)  # valid, and still nothing created: that is the tier's job
    assert os.listdir(tmp_path) == []
    cache = kvdist.create(good)
    assert os.listdir(tmp_path / "a/b/c") == []  # made now; its file has no name
    cache.close()


def test_vocab_size_beyond_the_tiny_model(tmp_path):
    _one_line(["run", "--config", _config(tmp_path, workload={"vocab_size": 10**12})],
              ["workload.vocab_size", "1000000000000"])


# Values the config took and the run could not handle (a traceback, a 34 GB allocation,
# minutes of generating a trace, a tier silently dropped): one line, exit 2, nothing built.
ACCEPTED_THEN_CRASHED = [
    ("seed", {"workload": {"seed": -1}}, ["workload.seed", "(got -1)", "greater than or equal to 0"]),
    ("inf rate", {"workload": {"arrival_rate": float("inf")}},
     ["workload.arrival_rate", "(got inf)", "finite"]),
    ("huge rate", {"workload": {"arrival_rate": 1.0e+20}}, ["workload.arrival_rate", "(got 1e+20)"]),
    ("int8", {"model": {"dtype": "int8"}}, ["model.dtype", "'int8'", "floating-point K/V"]),
    ("uint8", {"model": {"dtype": "uint8"}}, ["model.dtype", "'uint8'", "floating-point K/V"]),
    ("model at the maxima",
     {"model": {"num_layers": 1000}, "workload": {"vocab_size": 1 << 20, "hidden": 8192}},
     ["workload.hidden", "(got 8192)", "the model", "bytes this node has available"]),
    ("a trillion requests", {"workload": {"requests": 10**12}},
     ["workload.requests", "(got 1000000000000)", "the trace", "bytes this node has available"]),
    ("huge system prompt", {"workload": {"system_prompt_tokens": 10**8}},
     ["workload.system_prompt_tokens", "(got 100000000)",
      "needs 6,250,001 GPU blocks, more than the GPU tier's 64"]),
    ("host tier beyond memory", {"cache": {"host": {"bytes": "10000TB"}}, "workload": {"requests": 2}},
     ["cache.host.bytes", "(got 10000000000000000)", "bytes this node has available (MemAvailable)"]),
]


@pytest.mark.parametrize("sections, must", [c[1:] for c in ACCEPTED_THEN_CRASHED],
                         ids=[c[0] for c in ACCEPTED_THEN_CRASHED])
def test_values_the_run_cannot_handle_are_one_line(tmp_path, sections, must):
    out = tmp_path / "runs"
    _one_line(["run", "--config", _config(tmp_path, **sections), "--quiet", "--out", str(out)], must)
    assert not out.exists()


def test_out_directory_is_checked_before_the_run(tmp_path):
    if not os.path.isdir("/proc"):
        pytest.skip("no /proc here")
    _one_line(["run", "--config", _config(tmp_path), "--out", "/proc/x"],
              ["--out", "/proc/x", "not writable"])


@pytest.mark.parametrize("kind", ["directory", "file"])
def test_out_whose_latest_is_not_a_symlink_is_refused_before_the_run(tmp_path, kind):
    out = tmp_path / "runs"
    out.mkdir()
    latest = out / "latest"
    latest.mkdir() if kind == "directory" else latest.write_text("mine", encoding="utf-8")
    _one_line(["run", "--config", _config(tmp_path, workload={"requests": 2}), "--quiet", "--out", str(out)],
              ["--out", str(out), f"{latest} is a {kind}, not the symlink"])
    assert os.listdir(out) == ["latest"]  # no run directory, no temporary link


def test_a_failed_latest_link_leaves_no_temporary_link(tmp_path):
    from kvdist.sim.experiment import report

    run_dir = report.new_run_dir(tmp_path)
    (tmp_path / "latest").mkdir()  # made after the preflight: the replace fails
    with pytest.raises(OSError):
        report.point_latest(run_dir)
    assert sorted(os.listdir(tmp_path)) == sorted([run_dir.name, "latest"])


def test_metrics_port_out_of_range_or_in_use(tmp_path):
    cfg = _config(tmp_path)
    _one_line(["run", "--config", cfg, "--metrics-port", "70000"], ["--metrics-port", "70000", "1..65535"])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        _one_line(["run", "--config", cfg, "--metrics-port", str(port)],
                  ["--metrics-port", str(port), "127.0.0.1"])


def test_host_tier_warning_is_one_line_once_on_4_ranks(tmp_path):
    cfg = _config(tmp_path, workload={"requests": 2})
    code, out, err = finish(start(["run", "--config", cfg, "--quiet", "--out", str(tmp_path / "runs")], np=4,
                                  env={"KVDIST_FAULTS": "host_tier@2"}), timeout=180)
    assert code == 0, err
    said = [ln for ln in err.splitlines() if not ln.startswith("kvdist-launch:")]
    assert said == ["kvdist: running without the host tier on all 4 rank(s) (USE_NO_HOST): the host tier "
                    "could not be had on rank 2: HostTierUnavailable: fault drill KVDIST_FAULTS: host tier "
                    "unavailable on rank 2"], err  # once, with no source line under it
