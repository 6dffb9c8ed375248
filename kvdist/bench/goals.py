"""``python -m kvdist bench goals DIR``: every figure the GPU benchmarks wrote to ``DIR``
(``transfer.json``, ``layerwise.json``, ``pin.json``, as ``make gpu-bench`` writes them)
next to its goal, PASS or MISS. A file that is missing is named, not guessed; the exit
status is 0 whatever the figures (a benchmark reports, it does not gate)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from pathlib import Path

from tabulate import tabulate

__all__ = ["main", "rows"]

Row = tuple[str, str, str, bool]  # figure, measured, goal, met


def _pct(x: float, of: float) -> float:
    return 100 * x / of


def _transfer(d: dict) -> Iterator[Row]:
    for r in d["sizes"]:
        b = r["block"]
        for key, ceiling, goal in (("offload", "ceiling D2H", 95), ("onboard", "ceiling H2D", 95),
                                   ("both", "ceiling both", 90)):
            pct = _pct(r[key], r[ceiling])
            yield (f"bench transfer {b}: {key}", f"{r[key]:.1f} GB/s = {pct:.0f}% of {r[ceiling]:.1f}",
                   f">= {goal}%", pct >= goal)
        slow = r["slowdown"][0]
        yield f"bench transfer {b}: compute slowdown, copies meanwhile", f"{slow:+.1f}%", "< 5%", slow < 5


def _layerwise(d: dict) -> Iterator[Row]:
    for r in d["runs"]:
        if "no copies" in r["mode"]:
            continue
        b = f"{r['block'] >> 10} KiB" if r["block"] < 1 << 20 else f"{r['block'] >> 20} MiB"
        name = f"bench layerwise {b}, {r['mode']} ({r['groups']} groups)"
        yield (f"{name}: step vs no copies", f"{r['ratio']:.2f}x ({r['step_ms']:.1f} ms)", "<= 1.10x",
               r["ratio"] <= 1.10)
        yield f"{name}: compute slowdown", f"{100 * r['slowdown']:+.1f}%", "< 5%", r["slowdown"] < 0.05


def _pin(d: dict) -> Iterator[Row]:
    for r in d["sizes"]:
        if r["cuda"]:
            size = f"{r['bytes'] / (1 << 30):g} GiB"
            yield (f"bench pin {size}: host tier ready vs torch.empty(pin_memory=True)",
                   f"{r['speedup']:.1f}x ({r['kvdist_s']:.2f} vs {r['torch_s']:.2f} s)", ">= 4x",
                   r["speedup"] >= 4)


SOURCES: dict[str, Callable[[dict], Iterator[Row]]] = {
    "transfer.json": _transfer, "layerwise.json": _layerwise, "pin.json": _pin}


def rows(folder: Path) -> tuple[list[Row], list[str]]:
    """(figures with their goals, files that are missing)."""
    out, missing = [], []
    for name, read in SOURCES.items():
        path = folder / name
        if not path.exists():
            missing.append(name)
            continue
        out.extend(read(json.loads(path.read_text(encoding="utf-8"))))
    return out, missing


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvdist bench goals", description=__doc__.splitlines()[0])
    p.add_argument("folder", help="where the benchmarks wrote their --json files")
    args = p.parse_args(argv or [])
    found, missing = rows(Path(args.folder))
    print(tabulate([(f, m, g, "PASS" if ok else "MISS") for f, m, g, ok in found],
                   headers=["figure", "measured", "goal", ""]))
    met = sum(ok for *_, ok in found)
    print(f"{met} of {len(found)} goals met" + (f"; not measured: {', '.join(missing)}" if missing else ""))
    return 0
