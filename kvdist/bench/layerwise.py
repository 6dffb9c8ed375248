"""``python -m kvdist bench layerwise``: how long compute waits for onboarding, the whole
step at once (``cache.layer_groups: 1``) against layer by layer, at equal bytes.

Every step onboards ``--blocks`` blocks from the pinned host tier and offloads as many
(two prompts take turns on a GPU tier that holds one: each evicts the other), then
runs a forward pass of a Llama-3-8B-shaped layer stack on ``--tokens`` tokens (the
matmuls of one layer, and a read of that layer's reused K/V through ``kv_pool``),
32 layers, 2 MiB blocks. Per configuration, medians over the steps:

* compute wait: the time the compute stream stood still at the cache's waits
  (``stats()["compute_wait_seconds"]``: CUDA events around every wait);
* step: block_table and the forward pass, start to end on the compute stream;
* compute slowdown: the forward pass less its waits, against the same forward pass
  with no copies in flight (SMs or memory bandwidth taken by the copies);
* onboard GB/s: bytes onboarded over the time the onboard stream spent copying them
  (its own events), for the batched copies issued whole (1 group) or layer-major.

Without CUDA it prints that it needs CUDA and exits 0."""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from tabulate import tabulate

MODEL = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"}  # 2 MiB blocks


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvdist bench layerwise", description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=512, help="blocks onboarded (and offloaded) a step (512)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the forward pass (2048)")
    p.add_argument("--steps", type=int, default=12, help="measured steps per configuration (12)")
    p.add_argument("--groups", default="1,8,16,32", help="layer groups compared (1 = whole step)")
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


def _run(groups: int, n: int, tokens: int, steps: int, copies: bool) -> dict:
    import kvdist

    tpb = 16
    prompt = lambda base: list(range(base, base + n * tpb)) + [7]  # noqa: E731
    gpu_blocks = (n + 2) if copies else (2 * n + 4)  # no room for both prompts: they evict each other
    cache = kvdist.create({"model": MODEL, "cache": {
        "tokens_per_block": tpb, "device": "cuda", "gpu": {"blocks": gpu_blocks},
        "host": {"bytes": (2 * n + 8) * (2 << 20)}, "layer_groups": groups}})
    try:
        layers = _Layers(tokens, cache.device)
        stream = torch.cuda.current_stream()
        rows: list = []
        for i in range(steps + 3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            wait0 = cache.stats()["compute_wait_seconds"]
            start.record(stream)  # before block_table: a whole-step wait is there
            cache.begin_step()
            reused = cache.add_sequence(i, prompt(0 if i % 2 else 10**6))
            table = cache.block_table([i])
            blocks = table[0, : reused // tpb].long()
            for layer in range(MODEL["num_layers"]):
                layers.layer(cache.kv_pool(layer)[blocks[:64]])
            end.record(stream)
            end.synchronize()
            cache.end_step()
            cache.release(i)
            cache.synchronize()
            s = cache.stats()
            if i >= 3:  # warm-up: the first steps fill the tiers
                rows.append((start.elapsed_time(end) / 1e3, s["compute_wait_seconds"] - wait0, reused))
        s = cache.stats()
        moved = s["blocks_moved"]
        return {"groups": groups, "copies": copies,
                "step_ms": 1e3 * statistics.median(r[0] for r in rows),
                "wait_ms": 1e3 * statistics.median(r[1] for r in rows),
                "compute_ms": 1e3 * statistics.median(r[0] - r[1] for r in rows),
                "reused_blocks": rows[-1][2] // tpb, "onboarded": moved["onboard"],
                "offloaded": moved["offload"],
                "onboard_gb_per_s": s["recompute_policy"]["host_bytes_per_s"] / 1e9
                if s["recompute_policy"]["host_bytes_per_s"] else None}
    finally:
        cache.close()


def main(argv: list[str] | None = None) -> int:
    args = _args(argv or [])
    if not torch.cuda.is_available():
        print("bench layerwise needs CUDA")
        return 0
    groups = [int(g) for g in args.groups.split(",")]
    base = _run(1, args.blocks, args.tokens, args.steps, copies=False)
    results = [_run(g, args.blocks, args.tokens, args.steps, copies=True) for g in groups]
    whole = results[0]["wait_ms"] if groups[0] == 1 else None
    table = []
    for r in results:
        table.append([r["groups"], f"{r['onboarded']:,}", f"{r['wait_ms']:.2f}",
                      f"{100 * r['wait_ms'] / whole:.1f}%" if whole else "-", f"{r['step_ms']:.1f}",
                      f"{100 * (r['compute_ms'] / base['compute_ms'] - 1):+.1f}%",
                      f"{r['onboard_gb_per_s']:.1f}" if r["onboard_gb_per_s"] else "-"])
    print(f"bench layerwise: {args.blocks} blocks of 2 MiB onboarded and offloaded a step "
          f"({args.blocks * 2 / 1024:.1f} GiB each way), forward pass of 32 Llama-3-8B layers on "
          f"{args.tokens} tokens; without copies {base['step_ms']:.1f} ms a step")
    print(tabulate(table, headers=["layer groups", "blocks onboarded", "compute wait ms/step",
                                   "of whole step", "step ms", "compute slowdown", "onboard GB/s"],
                   colalign=("right",) * 7))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "no_copies": base, "runs": results}, f, indent=1)
    return 0
