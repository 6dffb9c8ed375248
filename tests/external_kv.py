"""Test support for ``cache.gpu: external``: configs, and CPU tensors laid out as vLLM
lays out its paged KV (vllm 0.33 ``create_kv_cache_views``: one flat buffer, a 4-D
logical view ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` per layer, the
physical order a permutation of ``[layer, block, token, head, K|V]``), and the older
5-D ``[2, num_blocks, block_size, heads, head_size]``."""

from __future__ import annotations

import torch

L, H, D, T = 3, 2, 4, 4  # layers, KV heads, head dim, tokens per block
DTYPE = "float16"
BLOCK_BYTES = L * 2 * T * H * D * 2


def config(host_blocks: int = 8, disk_blocks: int = 0, disk_path: str | None = None, **cache) -> dict:
    c = {"tokens_per_block": T, "device": "cpu", "gpu": "external",
         "host": {"bytes": host_blocks * BLOCK_BYTES}}
    if disk_blocks:
        c["disk"] = {"path": disk_path, "bytes": disk_blocks * BLOCK_BYTES}
    c.update(cache)
    return {"model": {"num_layers": L, "num_kv_heads": H, "head_dim": D, "dtype": DTYPE}, "cache": c}


def vllm_kv(num_blocks: int, order: str = "LBNHC", seed: int = 0, device: str = "cpu") -> list[torch.Tensor]:
    """Per-layer logical views ``[blocks, heads, tokens, 2*D]`` of one flat buffer laid
    out physically as ``order`` (LBNHC, LBHNC, BLNHC, or "separate": a buffer a layer),
    filled with random bytes."""
    C = 2 * D
    g = torch.Generator().manual_seed(seed)
    n = L * num_blocks * T * H * C
    flat = torch.randint(0, 256, (n * 2,), dtype=torch.uint8, generator=g).view(torch.float16).to(device)
    if order == "LBNHC":
        base = flat.view(L, num_blocks, T, H, C)
        return [base[i].permute(0, 2, 1, 3) for i in range(L)]
    if order == "LBHNC":
        base = flat.view(L, num_blocks, H, T, C)
        return [base[i] for i in range(L)]
    if order == "BLNHC":
        base = flat.view(num_blocks, L, T, H, C)
        return [base[:, i].permute(0, 2, 1, 3) for i in range(L)]
    assert order == "separate", order  # LBNHC, each layer an allocation of its own
    return [t.clone().permute(0, 2, 1, 3) for t in flat.view(L, num_blocks, T, H, C)]


def split_kv(num_blocks: int, kv_dim: int = 0, hnd: bool = False, seed: int = 0) -> list[torch.Tensor]:
    """The older per-layer ``[2, blocks, tokens, heads, D]`` (``kv_dim=1``: ``[blocks, 2,
    ...]``), NHD or HND strides, separate allocations."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(L):
        raw = torch.randint(0, 256, (2 * num_blocks * T * H * D * 2,), dtype=torch.uint8, generator=g)
        t = raw.view(torch.float16)
        outer = (2, num_blocks) if kv_dim == 0 else (num_blocks, 2)
        if hnd:
            out.append(t.view(*outer, H, T, D).transpose(2, 3))
        else:
            out.append(t.view(*outer, T, H, D))
    return out


def block_bytes(kv: list[torch.Tensor], block: int, layer: int, kv_dim: int = 0) -> torch.Tensor:
    """One engine block of one layer, its logical content as bytes (a copy)."""
    t = kv[layer]
    part = t[block] if t.dim() == 4 or kv_dim == 1 else t[:, block]
    return part.contiguous().view(torch.uint8).clone()


def snapshot(kv: list[torch.Tensor], kv_dim: int = 0) -> list[list[torch.Tensor]]:
    """Every block of every layer: ``[layer][block]`` bytes."""
    n = kv[0].shape[0] if kv[0].dim() == 4 else kv[0].shape[1 - kv_dim]
    return [[block_bytes(kv, b, layer, kv_dim) for b in range(n)] for layer in range(L)]
