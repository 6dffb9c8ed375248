import copy

import pytest

BASE = {
    "model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16"},
    "cache": {"tokens_per_block": 4, "device": "cpu", "gpu": {"blocks": 8}},
}


def make_cfg(**sections) -> dict:
    """BASE with nested overrides, e.g. make_cfg(cache={"host": {"bytes": 1024}})."""
    out = copy.deepcopy(BASE)
    for name, over in sections.items():
        out.setdefault(name, {})
        for k, v in over.items():
            if isinstance(v, dict) and isinstance(out[name].get(k), dict):
                out[name][k] = {**out[name][k], **v}
            else:
                out[name][k] = v
    return out


@pytest.fixture
def cfg_factory(tmp_path):
    def factory(gpu=8, host=0, disk=0, **cache):
        block = 2 * 2 * 4 * 2 * 8 * 2  # layers * kv * tpb * heads * dim * fp16
        c = {"gpu": {"blocks": gpu}, "host": {"bytes": host * block},
             "disk": {"path": str(tmp_path / "disk"), "bytes": disk * block}, **cache}
        return make_cfg(cache=c)
    return factory
