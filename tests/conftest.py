import copy
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import pytest

MPI_TESTS = Path(__file__).parent / "mpi"


def pytest_ignore_collect(collection_path, config):
    """tests/mpi runs in its own phase, under mpiexec with --with-mpi (``make mpi``): a
    plain run neither collects nor lists them as skips."""
    if collection_path == MPI_TESTS and not config.getoption("with_mpi", False):
        return True
    return None


_config = None


def pytest_configure(config):
    global _config
    _config = config


def pytest_runtest_logreport(report):
    """A failure's test and last line, printed when it happens, not only in the summary
    at the end: a CI whose log is cut or whose run is stopped still shows what failed."""
    if not report.failed or _config is None:
        return
    reporter = _config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    lines = [ln for ln in str(report.longreprtext).splitlines() if ln.strip()]
    errors = [ln[1:].strip() for ln in lines if ln.startswith("E ")][:2]
    where = lines[-1].strip() if lines else ""
    reporter.write_line(f"\nFAILED {report.nodeid} ({report.when}, {report.duration:.0f} s): "
                        f"{' / '.join(errors)[:400]} [{where[:200]}]")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skipped without it (``make gpu-test`` runs them,
    and fails on a machine without CUDA instead)."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in gpu:
            item.add_marker(skip)

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


@dataclass
class Probe:
    """Counts candidate builds and effective teardowns on this rank, and keeps weak
    references to every tier tensor and the disk file of each built candidate."""

    builds: list[tuple[bool, bool, str]] = field(default_factory=list)  # (with_host, fallback, outcome)
    teardowns: int = 0
    live: set[int] = field(default_factory=set)
    tensors: list[weakref.ref] = field(default_factory=list)
    files: list[str] = field(default_factory=list)


@pytest.fixture
def probe(monkeypatch):
    p = Probe()
    import kvdist.candidate

    real_build = kvdist.candidate.build_candidate
    real_teardown = kvdist.candidate.RankCache.teardown

    def build_candidate(cfg, capacity, device, rank, *, with_host=True, fallback=False, seams=None, **kw):
        try:
            local = real_build(cfg, capacity, device, rank, with_host=with_host, fallback=fallback,
                               seams=seams, **kw)
        except Exception as e:
            p.builds.append((with_host, fallback, type(e).__name__))
            raise
        p.builds.append((with_host, fallback, "ok"))
        p.live.add(id(local))
        p.tensors += [weakref.ref(t) for t in (local.gpu.data, getattr(local.host, "raw", None))
                      if t is not None]
        if local.disk is not None:  # the file has no name: where its descriptor points
            p.files.append(os.readlink(f"/proc/self/fd/{local.disk.fd}"))
        return local

    def teardown(self):
        if id(self) in p.live:
            p.live.discard(id(self))
            p.teardowns += 1
        real_teardown(self)

    monkeypatch.setattr(kvdist.candidate, "build_candidate", build_candidate)
    monkeypatch.setattr(kvdist.candidate.RankCache, "teardown", teardown)
    return p
