"""A GPU tier's size is checked against what this process can allocate: the driver's
free memory plus what torch's caching allocator holds unused. A configuration run after
another in one process (``run --compare``) found the earlier cache's freed GPU tier
counted as used and refused a tier that fits (H200, 2026-12-01: the replicas compare's
third configuration)."""

from __future__ import annotations

import pytest
import torch

from kvdist.candidate import cuda_free_bytes, plan_capacity
from kvdist.config import CacheConfig
from kvdist.errors import ConfigError
from kvdist.layout import KVLayout

GiB = 1 << 30


@pytest.fixture
def gpu_with_a_freed_tier(monkeypatch):
    """A device with 2 GiB free at the driver and 7 GiB reserved by torch, 1 GiB of it in use."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 7 * GiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 * GiB)


def _cfg(gpu_bytes: int) -> CacheConfig:
    return CacheConfig.model_validate({
        "model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32"},
        "cache": {"tokens_per_block": 16, "gpu": {"bytes": gpu_bytes}, "host": {"bytes": 0}}})


def test_the_allocators_unused_memory_counts_as_free(gpu_with_a_freed_tier):
    assert cuda_free_bytes(torch.device("cuda", 0)) == 8 * GiB


def test_a_tier_that_fits_in_freed_memory_is_planned_and_one_that_does_not_is_refused(gpu_with_a_freed_tier):
    cfg = _cfg(6 * GiB)
    layout = KVLayout.from_config(cfg)
    gpu, _, _ = plan_capacity(cfg, layout, torch.device("cuda", 0))
    assert gpu == 6 * GiB // layout.bytes_per_block
    with pytest.raises(ConfigError, match="cache.gpu.bytes") as err:
        plan_capacity(_cfg(9 * GiB), layout, torch.device("cuda", 0))
    assert "8,589,934,592 bytes cuda:0 has free" in str(err.value)
