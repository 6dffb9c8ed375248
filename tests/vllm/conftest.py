"""The vLLM connector's tests run in .venv-vllm (``make vllm``, a step of ``make test``),
with vllm==0.33.0 installed. In .venv (``make unit``) they are not collected: that venv
has no vLLM. Where .venv-vllm could not be built, ``make vllm`` runs them in .venv with
KVDIST_VLLM_SKIP set to why, and each module skips saying so (``vllm_or_skip``)."""

import importlib.util
import os

import pytest

if importlib.util.find_spec("vllm") is None and not os.environ.get("KVDIST_VLLM_SKIP"):
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from .harness import model_config

    return model_config(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def engine(model, tmp_path):
    """make(tier="host", **kvdist cache keys, load_async=...) -> an Engine; closed after.
    The recompute policy is off unless asked for (``recompute_when_faster="true"``): the
    stand-in forward's speed would otherwise decide whether a hit is loaded."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from .harness import NUM_BLOCKS, Engine, vllm_config

    made = []

    def make(tier: str = "host", layout: KVCacheLayout | None = None, load_async: bool | None = None,
             tp: int = 1, num_blocks: int = NUM_BLOCKS, **cache) -> Engine:
        lines = ["cache:", "  device: cpu"]
        if tier == "host":
            lines.append("  host: {bytes: 64KiB}")  # 16 blocks of 4 KiB
        else:
            lines += ["  host: {bytes: 0}", f"  disk: {{path: {tmp_path / 'disk'}, bytes: 64KiB}}"]
        cache = {"recompute_when_faster": "false", **cache}
        disk_keys = {k: cache.pop(k) for k in list(cache) if k.startswith("disk_")}
        if disk_keys:
            lines[-1] = lines[-1][:-1] + "".join(f", {k[5:]}: {v}" for k, v in disk_keys.items()) + "}"
        lines += [f"  {k}: {v}" for k, v in cache.items()]
        (tmp_path / "kvdist.yaml").write_text("\n".join(lines) + "\n", encoding="utf-8")
        extra = {} if load_async is None else {"load_async": load_async}
        e = Engine(vllm_config(model, tmp_path / "kvdist.yaml", num_blocks, **extra), num_blocks,
                   layout or KVCacheLayout.LBNHC, tp)
        e.tier = tier
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()
