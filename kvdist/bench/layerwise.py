"""``python -m kvdist bench layerwise``: what onboarding costs a forward step, by block
size, at equal bytes: the step with copies against the same step without.

Every step onboards 1 GiB (``--gib``) of reused blocks from the pinned host tier and
offloads as much, then runs a forward pass of a Llama-3-8B-shaped layer stack on
``--tokens`` tokens (the matmuls of one layer, and a read of that layer's reused K/V
through ``kv_pool``), 32 layers, 128 KiB of K/V a token, so a block of 128 KiB, 512 KiB
or 2 MiB holds 1, 4 or 16 tokens. Configurations, side by side:

* no copies: the prompt stays in the GPU tier (the reference step);
* serial, layer groups 1 or auto (``cache.layer_groups``): the host schedules a step
  only once the last one is done, so a step's copies can only hide behind its own
  forward pass, layer by layer;
* run ahead: the host schedules step N+1 (its admission's offloads and onboards) while
  step N computes (three prompts take turns on a GPU tier that holds two): the copies
  hide behind the step before, at any block size (rule S4 per slot lets them start);
  and the same loop on a GPU tier that holds all three (no copies), its reference.

Per configuration, over the measured steps: step ms (wall time a step; running ahead,
the mean over the run, host and GPU overlapping) and its ratio to no copies; host ms
(``begin_step`` to ``block_table``: admission, eviction, handing copies to the driver);
forward ms (the GPU from the first layer's kernels to the last's, waits included);
compute wait (``stats()["compute_wait_seconds"]``: CUDA events around every wait of the
compute stream); compute slowdown (the forward pass less its waits, against the one
without copies); onboard GB/s (the onboard stream's own events). Without CUDA it
prints that it needs CUDA and exits 0."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from tabulate import tabulate

from ..units import parse_size

TOKEN_BYTES = 128 << 10  # 32 layers x 8 K/V heads x 128 dims x K and V x bf16
MODEL = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"}
PASS = ("no copies", "serial, 1 group", "serial, auto", "run ahead, no copies", "run ahead, auto")


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvdist bench layerwise", description=__doc__.splitlines()[0])
    p.add_argument("--block-size", default="128KiB,512KiB,2MiB", help="block sizes, at equal bytes")
    p.add_argument("--gib", type=float, default=1.0, help="GiB onboarded (and offloaded) a step (1)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the forward pass (2048)")
    p.add_argument("--steps", type=int, default=10, help="measured steps per configuration (10)")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    return p.parse_args(argv)


class _Layers:
    """The matmuls of one Llama-3-8B layer on ``tokens`` tokens, plus a read of the
    layer's reused K/V (what attention would do first)."""

    def __init__(self, tokens: int, device: torch.device):
        g = torch.Generator(device=device).manual_seed(0)
        mk = lambda *s: torch.randn(*s, generator=g, device=device, dtype=torch.bfloat16) * 0.02  # noqa: E731
        self.x = mk(tokens, 4096)
        self.wqkv, self.w13 = mk(4096, 6144), mk(4096, 28672)
        self.w2, self.wo = mk(14336, 4096), mk(4096, 4096)

    def layer(self, kv: torch.Tensor) -> torch.Tensor:
        h = self.x @ self.wqkv
        a = kv.float().mean() + h[:, :4096]
        gate, up = (self.x @ self.w13).chunk(2, dim=-1)
        return (a @ self.wo) + (torch.nn.functional.silu(gate) * up) @ self.w2


def _cache(block: int, n: int, groups: int | str, gpu_blocks: int):
    import kvdist

    return kvdist.create({"model": MODEL, "cache": {
        "tokens_per_block": block // TOKEN_BYTES, "device": "cuda", "gpu": {"blocks": gpu_blocks},
        "host": {"bytes": (3 * n + 8) * block}, "layer_groups": groups}})


def _forward(cache, layers: _Layers, table: torch.Tensor, reused_blocks: int) -> None:
    blocks = table[0, :reused_blocks].long()[:64]
    for layer in range(MODEL["num_layers"]):
        layers.layer(cache.kv_pool(layer)[blocks])


def _run(mode: str, block: int, n: int, tokens: int, steps: int) -> dict:
    """One configuration; ``n`` blocks a prompt."""
    tpb = block // TOKEN_BYTES
    prompts = [list(range(k * 10**6, k * 10**6 + n * tpb)) + [7] for k in range(3)]
    ahead, groups = mode.startswith("run ahead"), "auto" if mode.endswith("auto") else 1
    turns = 3 if ahead else 1 if mode == "no copies" else 2  # prompts taking turns
    room = 3 if ahead and mode.endswith("no copies") else 1 if turns == 2 else 2  # sequences the GPU holds
    gpu_blocks = room * (n + 1) + 2
    cache = _cache(block, n, groups, gpu_blocks)
    try:
        layers, stream = _Layers(tokens, cache.device), torch.cuda.current_stream()
        warm = 3 * turns  # the first steps fill the tiers
        host, gpu, walls, last_end = [], [], [], None
        for i in range(warm + steps):
            if i == warm:
                torch.cuda.synchronize()
                wait0, t_first = cache.stats()["compute_wait_seconds"], time.perf_counter()
            t0 = time.perf_counter()
            cache.begin_step()
            reused = cache.add_sequence(i, prompts[i % turns])
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)  # before block_table: a whole-step wait (S5) is there
            table = cache.block_table([i])
            t1 = time.perf_counter()
            _forward(cache, layers, table, reused // tpb)
            end.record(stream)
            cache.end_step()
            if ahead:  # the host schedules the next step while this one runs
                if i:
                    cache.release(i - 1)
                if last_end is not None:
                    last_end.synchronize()
                last_end = end
            else:
                end.synchronize()
                cache.release(i)
            if i >= warm:
                host.append(t1 - t0)
                gpu.append((start, end))
                walls.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t_first) / steps if ahead else statistics.median(walls)
        s = cache.stats()
        rate = s["recompute_policy"]["host_bytes_per_s"]
        c = cache.config.cache
        used = cache.layout.groups_for(c.layer_groups, c.min_copy_piece)
        return {"mode": mode, "block": block, "groups": used,
                "step_ms": 1e3 * wall, "host_ms": 1e3 * statistics.median(host),
                "forward_ms": statistics.median(a.elapsed_time(b) for a, b in gpu),
                "wait_ms": 1e3 * (s["compute_wait_seconds"] - wait0) / steps, "reused_blocks": reused // tpb,
                "onboarded": s["blocks_moved"]["onboard"], "onboard_gb_per_s": rate / 1e9 if rate else None}
    finally:
        cache.close()


def main(argv: list[str] | None = None) -> int:
    args = _args(argv or [])
    if not torch.cuda.is_available():
        print("bench layerwise needs CUDA")
        return 0
    table, results = [], []
    for size in args.block_size.split(","):
        block = parse_size(size)
        assert block % TOKEN_BYTES == 0 and (block // TOKEN_BYTES) & (block // TOKEN_BYTES - 1) == 0, \
            f"a block of {size} is not a power of two of 128 KiB tokens"
        n = int(args.gib * (1 << 30)) // block
        runs = [_run(mode, block, n, args.tokens, args.steps) for mode in PASS]
        for r in runs:  # against the same loop without copies
            base = runs[3 if r["mode"].startswith("run ahead") else 0]
            r["ratio"] = r["step_ms"] / base["step_ms"]
            r["slowdown"] = (r["forward_ms"] - r["wait_ms"]) / base["forward_ms"] - 1
            table.append([size, r["mode"], r["groups"], f"{r['step_ms']:.1f}", f"{r['ratio']:.2f}x",
                          f"{r['host_ms']:.1f}", f"{r['forward_ms']:.1f}", f"{r['wait_ms']:.2f}",
                          f"{100 * r['slowdown']:+.1f}%",
                          f"{r['onboard_gb_per_s']:.1f}" if r["onboard_gb_per_s"] else "-"])
        results += runs
    print(f"bench layerwise: {args.gib:g} GiB of blocks onboarded and offloaded a step, forward pass of 32 "
          f"Llama-3-8B layers on {args.tokens} tokens")
    print(tabulate(table, headers=["block", "configuration", "groups", "step ms", "vs no copies",
                                   "host ms", "forward ms", "compute wait ms", "compute slowdown",
                                   "onboard GB/s"], colalign=("left", "left") + ("right",) * 8))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "runs": results}, f, indent=1)
    return 0
