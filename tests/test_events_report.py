"""The main job with KV cache events on reports its publisher: where it publishes, the
steps it was handed, published and dropped (``results["events"]``, one line of the
report per publishing rank); with events off, nothing."""

from __future__ import annotations

import re

import pytest

import kvdist
from kvdist.sim.experiment.job import solo
from kvdist.sim.experiment.options import RunOptions
from kvdist.sim.experiment.report import render

from .conftest import make_cfg
from .test_sim_unit import W

pytest.importorskip("zmq")

ANY = "tcp://127.0.0.1:0"


def _run(tmp_path, events: dict) -> dict:
    cfg = kvdist.load_config(make_cfg(
        model={"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"},
        cache={"device": "cpu", "gpu": {"blocks": 64}, "host": {"bytes": 24 * 1024},
               "disk": {"path": str(tmp_path / "disk"), "bytes": 400 * 1024},
               "recompute_when_faster": False, "events": events},
        workload={**W, "requests": 40}))
    sim = solo(cfg, RunOptions(out=None, progress=False))
    try:
        return sim.run()
    finally:
        sim.close()


def test_the_main_job_reports_its_events_publisher(tmp_path):
    r = _run(tmp_path, {"enabled": True, "endpoint": ANY, "replay_endpoint": ANY})
    assert r["ok"]
    (e,) = r["events"]
    assert (e["rank"], e["replica"], e["dropped"], e["replays"]) == (0, 0, 0, 0)
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", e["endpoint"]) and e["endpoint"] != ANY
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", e["replay_endpoint"])
    assert e["replay_endpoint"] != e["endpoint"]
    # A step that changed no block (some decode steps) hands nothing over.
    assert 0 < e["submitted"] <= r["steps"] and 0 <= e["published"] <= e["submitted"]
    line = (f"KV cache events of replica 0 (rank 0) on {e['endpoint']} (replay {e['replay_endpoint']}): "
            f"{e['submitted']:,} steps with block changes, {e['published']:,} published by the run's end, "
            f"0 dropped, 0 replays")
    assert line in render(r).splitlines()


def test_without_events_the_report_has_no_events_line(tmp_path):
    r = _run(tmp_path, {"enabled": False})
    assert r["ok"] and r["events"] == []
    assert "KV cache events" not in render(r)


def test_a_fixed_endpoint_is_bound_once(tmp_path):
    """The run's cache alone publishes: the replays beside it (``shadows.py``, the
    gpu-only and no-reuse policies) have no events, so a port written in the config is
    bound once (each replay bound it again: 'Address already in use' on rank 0, and its
    peers waited for it at the first step)."""
    import socket

    with socket.socket() as s:  # a port free now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    r = _run(tmp_path, {"enabled": True, "endpoint": endpoint})
    assert r["ok"]
    (e,) = r["events"]
    assert e["endpoint"] == endpoint
