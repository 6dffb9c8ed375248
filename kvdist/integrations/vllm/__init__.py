"""kvdist as a vLLM v1 KV connector (vllm==0.33.0): vLLM owns the GPU KV tensors and its
GPU prefix cache; kvdist keeps the host, disk and remote tiers behind them. See
``connector`` for the KVTransferConfig lines, README "Running vLLM with kvdist"."""

__all__ = ["KVDistConnector", "launcher_env"]

from .connector import KVDistConnector
from .launcher import launcher_env
