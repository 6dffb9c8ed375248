"""PNG plots of a run (matplotlib, Agg backend: no display needed): hit rate and tier
occupancy over time, bytes moved per step."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .metrics import TIERS, Timeline

_COLORS = {"gpu": "#2b6cb0", "host": "#dd6b20", "disk": "#718096"}


def _per_step(cumulative: list[int]) -> np.ndarray:
    a = np.asarray(cumulative, dtype=np.float64)
    return np.diff(a, prepend=0.0)


def _rolling(a: np.ndarray, window: int) -> np.ndarray:
    """Sum over the last ``window`` steps."""
    c = np.cumsum(np.concatenate([[0.0], a]))
    lo = np.maximum(np.arange(1, len(a) + 1) - window, 0)
    return c[1:] - c[lo]


def write_plots(run_dir: Path, tl: Timeline, block_bytes: int, world_size: int) -> list[Path]:
    """Write the plots into ``run_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(1, tl.steps + 1)
    window = max(10, tl.steps // 50)
    tiers = [t for t in TIERS if t in tl.capacity]
    paths = []

    prompt = _rolling(_per_step(tl.prompt_tokens), window)
    denom = np.where(prompt > 0, prompt, np.nan)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    rates = [100 * _rolling(_per_step(tl.reused[t]), window) / denom for t in tiers]
    ax.stackplot(steps, *[np.nan_to_num(r) for r in rates], labels=[f"reused from {t}" for t in tiers],
                 colors=[_COLORS[t] for t in tiers], alpha=0.8)
    if tl.reused_gpu_only:
        ax.plot(steps, 100 * _rolling(_per_step(tl.reused_gpu_only), window) / denom, color="black",
                lw=1.2, ls="--", label="gpu-only reuse (replay)")
    ax.set(xlabel="step", ylabel=f"% of prompt tokens reused ({window}-step window)",
           title="Prefix hit rate by tier", ylim=(0, 100))
    ax.legend(loc="lower right")
    paths.append(_save(fig, run_dir / "hit_rate.png"))

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for t in tiers:
        ax.plot(steps, 100 * np.asarray(tl.used[t]) / tl.capacity[t], color=_COLORS[t],
                label=f"{t} ({tl.capacity[t]:,} blocks)")
    ax.set(xlabel="step", ylabel="% of the tier's blocks in use", title="Tier occupancy (per rank)",
           ylim=(0, 105))
    ax.legend(loc="lower right")
    paths.append(_save(fig, run_dir / "occupancy.png"))

    fig, ax = plt.subplots(figsize=(9, 4.5))
    scale = block_bytes * world_size / 2**20
    for m, color in (("offload", _COLORS["host"]), ("onboard", _COLORS["gpu"]), ("demote", _COLORS["disk"]),
                     ("reload", "#38a169"), ("spill", "#e53e3e")):
        per_step = _per_step(tl.moved[m]) * scale
        if per_step.any():
            ax.plot(steps, _rolling(per_step, window) / window, color=color, lw=1.2, label=m)
    ax.set(xlabel="step", ylabel=f"MiB per step, all ranks ({window}-step mean)",
           title="Bytes moved between tiers" + ("" if ax.lines else " (none)"))
    if ax.lines:
        ax.legend(loc="upper right")
    paths.append(_save(fig, run_dir / "bytes_moved.png"))
    return paths


def ttft_cdf(run_dir: Path, ttft_s: dict[str, list[float]], rate: float) -> Path:
    """The TTFT distribution of each configuration of a comparison, as CDFs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"all-tiers": _COLORS["gpu"], "gpu-only": _COLORS["host"], "no-reuse": _COLORS["disk"]}
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, values in ttft_s.items():
        x = np.sort(np.asarray(values)) * 1e3
        ax.step(x, np.arange(1, len(x) + 1) / max(len(x), 1), where="post", color=colors.get(name),
                label=f"{name} (p50 {np.median(x):.0f} ms)" if len(x) else name)
    ax.set(xscale="log", xlabel="time to first token (ms, log scale)", ylabel="share of requests",
           title=f"TTFT, the same trace at {rate:g} requests/s", ylim=(0, 1.01))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return _save(fig, run_dir / "ttft_cdf.png")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
