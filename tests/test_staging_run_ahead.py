"""The main job running ahead (``workload.run_ahead``): step N+1's admissions,
prefetches, appends and ``block_table`` are prepared while step N's forward pass is
still queued, and every rule holds.

On CPU with simulated streams the pass is a queued 'kernel' and the block tables'
uploads wait on the stream like it (the device runs behind the host), so the
preparation of step N+1 really does rewrite host memory while step N's copies are
queued: with the staging ring cut to one buffer, only rule S3's wait for that buffer's
queued upload keeps step N's table intact. The CUDA variants (``gpu``) run the same
job on a GPU, and check that each layer waits for its own copies (rule S5 by layer)."""

from __future__ import annotations

import time

import pytest
import torch

import kvdist
import kvdist.sim.experiment.parts as parts
import kvdist.testing
from kvdist.errors import KVDistError
from kvdist.sim.experiment.job import solo
from kvdist.sim.experiment.options import RunOptions
from kvdist.testing import Seams

from .conftest import make_cfg
from .test_sim_unit import sim_cfg

SAME = ("reused_tokens", "prefill_tokens_computed", "steps", "requests", "blocks_moved_per_rank",
        "evictions_by_tier", "bytes_onboarded", "bytes_offloaded", "bytes_demoted")


def _run(tmp_path, monkeypatch, *, ahead: bool, seams: Seams | None = None, **cache) -> tuple[dict, dict]:
    """The main job on ``cache`` overrides; its results and staging figures."""
    cfg = sim_cfg(tmp_path, run_ahead=ahead)
    if cache:
        cfg = cfg.replace(cache=cache)
    if seams is not None:
        monkeypatch.setattr(parts, "create", lambda c, comm=None: kvdist.testing.create(c, seams, comm))
    sim = solo(cfg, RunOptions(out=None, progress=False))
    try:
        r = sim.run()
        return r, sim.cache.stats()["staging"]
    finally:
        sim.close()


def test_running_ahead_serves_the_trace_as_the_serial_loop_does(tmp_path, monkeypatch):
    serial, _ = _run(tmp_path / "a", monkeypatch, ahead=False)
    ahead, _ = _run(tmp_path / "b", monkeypatch, ahead=True)
    assert serial["ok"] and ahead["ok"]
    assert {k: ahead[k] for k in SAME} == {k: serial[k] for k in SAME}
    assert ahead["integrity"]["blocks_checked"] == serial["integrity"]["blocks_checked"] > 100
    assert ahead["integrity"]["logits_checked"] == serial["integrity"]["logits_checked"] > 0
    assert ahead["integrity_mismatches"] == 0 and ahead["integrity"]["logits_failed"] == 0
    assert ahead["critical_path"]["run_ahead"] and not serial["critical_path"]["run_ahead"]


def test_running_ahead_with_the_staging_ring_at_its_minimum_finds_no_bad_blocks(tmp_path, monkeypatch):
    """One staging buffer: every step's table waits for the previous one's queued
    upload (ring waits), and nothing read through a table is wrong. The serial loop it
    is compared with runs on simulated streams too: there a prefetch's reads run when
    an end_step polls them, so a request waits a step for them, as on a GPU (with
    copies done inside each call it never waits)."""
    serial, _ = _run(tmp_path / "a", monkeypatch, ahead=False, simulate_async=True)
    r, staging = _run(tmp_path / "b", monkeypatch, ahead=True, seams=Seams(staging_slots=1),
                      simulate_async=True)
    assert r["ok"], r["integrity"]
    assert r["integrity_mismatches"] == 0 and r["integrity"]["logits_failed"] == 0
    assert {k: r[k] for k in SAME} == {k: serial[k] for k in SAME}
    assert r["integrity"]["blocks_checked"] == serial["integrity"]["blocks_checked"]
    assert staging["slots"] == 1 and staging["path"] == "simulated"
    assert staging["ring_waits"] > 0  # the host was a step ahead of the device's uploads


def test_serially_the_one_buffer_ring_never_waits(tmp_path, monkeypatch):
    """The contrast: the serial loop waits for each step's pass before the next table,
    so one buffer is never rewritten under a queued upload."""
    r, staging = _run(tmp_path, monkeypatch, ahead=False, seams=Seams(staging_slots=1), simulate_async=True)
    assert r["ok"] and staging["slots"] == 1 and staging["ring_waits"] == 0


def test_running_ahead_without_rule_s3_corrupts(tmp_path, monkeypatch):
    """S3 removed (one staging buffer, rewritten under queued uploads): step N+1's
    table overwrites step N's before its upload ran, and the job reads through the
    wrong table — wrong blocks, or entries that are no block at all."""
    try:
        r, _ = _run(tmp_path, monkeypatch, ahead=True, seams=Seams(protect_staging=False),
                    simulate_async=True)
        clean = r["ok"] and r["integrity_mismatches"] == 0
    except (IndexError, KVDistError):  # a table entry out of the pool: what a GPU would fault on
        clean = False
    assert not clean


# -- on a GPU ---------------------------------------------------------------------------------------
def _cuda_cfg(tmp_path, **workload):
    cfg = sim_cfg(tmp_path, **workload)
    return cfg.replace(cache={"device": "cuda"}, workload={"compute_dtype": "float32", "cuda_graphs": False})


@pytest.mark.gpu
def test_cuda_running_ahead_with_the_staging_ring_at_its_minimum_finds_no_bad_blocks(tmp_path, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    seams = Seams(staging_slots=1)
    monkeypatch.setattr(parts, "create", lambda c, comm=None: kvdist.testing.create(c, seams, comm))
    results = {}
    for ahead in (False, True):
        sim = solo(_cuda_cfg(tmp_path / str(ahead), run_ahead=ahead), RunOptions(out=None, progress=False))
        try:
            results[ahead] = sim.run()
            assert sim.cache.stats()["staging"]["slots"] == 1
        finally:
            sim.close()
    serial, ahead = results[False], results[True]
    assert ahead["ok"], ahead["integrity"]
    assert ahead["integrity_mismatches"] == 0 and ahead["integrity"]["logits_failed"] == 0
    # On a GPU a request whose prefix is on disk joins the batch once its reads landed,
    # which the disk's timing decides: the two runs serve the same requests, not
    # necessarily in the same steps (the CPU tests above compare the steps too).
    assert ahead["requests"] == serial["requests"] and ahead["prompt_tokens"] == serial["prompt_tokens"]
    assert ahead["critical_path"]["timers"] == "cuda events"


LAYERS = 4


@pytest.mark.gpu
@pytest.mark.parametrize("layer", range(1, LAYERS))
def test_cuda_a_layer_waits_for_its_own_group_not_the_one_before(layer):
    """``kv_pool(layer)`` makes compute wait for ``layer``'s group of the onboarded
    blocks. Groups before ``layer`` have landed, ``layer``'s is held behind a spin gate
    (after it, a flag is set): compute's read of the flag must wait for the gate.
    Waiting for group ``layer - 1`` instead reads the flag at once, unset."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kvdist.transfer.cuda_events import Grouped

    from .cuda_gate import SpinGate

    seams = Seams()
    cfg = make_cfg(model={"num_layers": LAYERS, "num_kv_heads": 2, "head_dim": 64, "dtype": "float32"},
                   cache={"device": "cuda", "tokens_per_block": 4, "gpu": {"blocks": 4},
                          "layer_groups": LAYERS})
    cache = kvdist.testing.create(kvdist.load_config(cfg), seams)
    try:
        ex, dev = seams.executor, cache.device
        flag, seen = torch.zeros(1, device=dev), torch.zeros(1, device=dev)
        landed, held = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
        flag.fill_(0.0)
        seen.copy_(flag)  # the kernels load before the gate closes
        torch.cuda.synchronize(dev)
        gate = SpinGate(timeout_s=4.0).close(held)
        events = []
        for g in range(LAYERS):
            stream = landed if g < layer else held
            if g == layer:
                with torch.cuda.stream(held):
                    flag.fill_(1.0)  # group `layer` lands behind the gate
            ev = torch.cuda.Event()
            ev.record(stream)
            events.append(ev)
        torch.cuda.current_stream(dev).wait_stream(landed)
        ex.compute_wait([Grouped(events)], layered=True)
        ex.wait_layer(layer)
        seen.copy_(flag)  # compute reads what group `layer` wrote
        time.sleep(0.2)  # waiting for the wrong group, the read has run by now
        gate.open()
        gate.check()
        torch.cuda.synchronize(dev)
        assert float(seen) == 1.0
    finally:
        cache.close()
