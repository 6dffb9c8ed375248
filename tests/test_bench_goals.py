"""``bench goals`` reads what the GPU benchmarks wrote and sets each figure against its
goal; checked here on files written by hand in the benchmarks' formats."""

from __future__ import annotations

import json

from kvdist.bench import goals


def _write(tmp_path, name: str, data: dict) -> None:
    (tmp_path / name).write_text(json.dumps(data), encoding="utf-8")


def test_each_figure_against_its_goal(tmp_path, capsys):
    _write(tmp_path, "transfer.json", {"sizes": [{
        "block": "128KiB", "offload": 54.1, "ceiling D2H": 55.1, "onboard": 51.0, "ceiling H2D": 54.7,
        "both": 90.5, "ceiling both": 92.8, "slowdown": [-1.5, 53.0]}]})
    _write(tmp_path, "layerwise.json", {"runs": [
        {"mode": "no copies", "block": 2 << 20, "groups": 1, "ratio": 1.0, "slowdown": 0.0, "step_ms": 49.7},
        {"mode": "serial, auto", "block": 2 << 20, "groups": 8, "ratio": 1.1, "slowdown": 0.003,
         "step_ms": 54.7},
        {"mode": "run ahead, auto", "block": 128 << 10, "groups": 1, "ratio": 1.9, "slowdown": 0.064,
         "step_ms": 97.1}]})
    found, missing = goals.rows(tmp_path)
    assert missing == ["pin.json"]
    assert [(f, ok) for f, _, _, ok in found] == [
        ("bench transfer 128KiB: offload", True),  # 98%
        ("bench transfer 128KiB: onboard", False),  # 93% < 95%
        ("bench transfer 128KiB: both", True),  # 98%
        ("bench transfer 128KiB: compute slowdown, copies meanwhile", True),
        ("bench layerwise 2 MiB, serial, auto (8 groups): step vs no copies", True),  # 1.10x
        ("bench layerwise 2 MiB, serial, auto (8 groups): compute slowdown", True),
        ("bench layerwise 128 KiB, run ahead, auto (1 groups): step vs no copies", False),
        ("bench layerwise 128 KiB, run ahead, auto (1 groups): compute slowdown", False)]
    assert found[1][1] == "51.0 GB/s = 93% of 54.7"
    assert goals.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "5 of 8 goals met; not measured: pin.json" in out and out.count("MISS") == 3
