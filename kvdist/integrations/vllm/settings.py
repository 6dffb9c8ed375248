"""The kvdist config a connector runs with: the user's kvdist config file (tiers, sizes,
policies) completed with what vLLM already knows — the KV geometry of one worker (its
layers, its KV heads after the TP split, head size, dtype) and the block size — so the
user writes each fact once. The scheduler and every worker derive the same config from
the same file and vLLM's ``KVCacheConfig``: the planner numbers slots in the tiers the
workers build. No vLLM import at module level."""

from __future__ import annotations

__all__ = ["kvdist_config", "layout_of"]

import os
from typing import TYPE_CHECKING

import yaml

from ...config import CacheConfig, load_config
from ...errors import ConfigError
from ...layout import KVLayout

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

_KEY = "kv_connector_extra_config.kvdist_config"


def layout_of(kv_cache_config: KVCacheConfig) -> KVLayout:
    """One worker's KV as vLLM allocates it (the ``model:`` section kvdist needs), from
    vLLM's KV cache config: one group of full-attention layers."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError("kv_connector", "KVDistConnector",
                          f"needs one KV cache group of full attention; this model has {len(groups)}")
    spec = groups[0].kv_cache_spec
    head_v = getattr(spec, "head_size_v", spec.head_size)
    if head_v != spec.head_size:
        raise ConfigError("kv_connector", "KVDistConnector",
                          f"needs K and V of one size (head_size {spec.head_size}, head_size_v {head_v})")
    return KVLayout(len(groups[0].layer_names), spec.num_kv_heads, spec.head_size,
                    str(spec.dtype).removeprefix("torch."), spec.block_size)


def kvdist_config(path: str | os.PathLike | None, layout: KVLayout) -> CacheConfig:
    """The user's file with ``model:``, ``cache.tokens_per_block`` and ``cache.gpu:
    external`` from vLLM. A value the file gives for one of those must agree with
    vLLM's, else ConfigError naming it."""
    if path is None:
        raise ConfigError(_KEY, None, "give the kvdist config file (its host and disk tiers)")
    try:
        data = yaml.safe_load(open(path, encoding="utf-8").read()) or {}
    except OSError as e:
        raise ConfigError(_KEY, str(path), f"cannot read the config file: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(_KEY, str(path), f"not valid YAML: {e}".replace("\n", " ")) from None
    if not isinstance(data, dict):
        raise ConfigError(_KEY, str(path), "the config must be a mapping")
    g = layout
    model = {"num_layers": g.num_layers, "num_kv_heads": g.num_kv_heads, "head_dim": g.head_dim,
             "dtype": g.dtype}
    cache = {"tokens_per_block": g.tokens_per_block, "gpu": "external"}
    for section, values in (("model", model), ("cache", cache)):
        given = data.get(section) or {}
        if not isinstance(given, dict):
            raise ConfigError(section, given, "must be a mapping")
        for key, value in values.items():
            if key in given and given[key] != value:
                raise ConfigError(f"{section}.{key}", given[key], f"vLLM runs with {value}: leave it out")
        data[section] = {**given, **values}
    return load_config(data)
