"""The CUDA executor's own logic on a machine without CUDA: its per-route handlers, the
disk batches on worker threads (demote, spill, reload with their bounce buffers and
GPU halves), the host waits, ``compute_wait``, ``synchronize``, ``is_done`` and
``stats``, with CUDA streams and events replaced by stand-ins whose copies run at
once on CPU tensors. Random copy streams through the transfer engine must leave
every slot with the bytes a sequential replay gives; disk I/O is slowed down so a
missing wait for a worker shows up as wrong bytes.

What this cannot see: the GPU running behind the host (every stand-in copy is done
when submitted). ``test_transfer_cuda.py`` covers that on a real GPU."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import numpy as np
import pytest
import torch

from kvdist.blocks import SlotSpace
from kvdist.layout import KVLayout
from kvdist.storage import DiskPool, GpuPool, HostPool
from kvdist.transfer import DEMOTE, OFFLOAD, ONBOARD, PROMOTE, RELOAD, TransferEngine
from kvdist.transfer import cuda as cuda_executor

from .test_transfer_engine import _queue, _random_moves

LAYOUT = KVLayout(num_layers=4, num_kv_heads=1, head_dim=4, dtype="uint8", tokens_per_block=4)


class FakeEvent:
    def __init__(self, enable_timing: bool = False):
        self.timing = enable_timing

    def elapsed_time(self, end) -> float:
        assert self.timing and end.timing, "elapsed_time between events without timing"
        return 0.5

    def record(self, stream=None) -> None:
        self.recorded = True

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class FakeStream:
    cuda_stream = 0

    def __init__(self, device=None):
        self.waited: list[FakeEvent] = []

    def wait_event(self, event) -> None:
        assert isinstance(event, FakeEvent), f"a stream waits for {event!r}"
        self.waited.append(event)

    def synchronize(self) -> None:
        pass


class FakeCopier:
    """BatchCopier's interface; the copy runs now."""

    def __init__(self, device, prefer=None):
        self.path = prefer or "fake"
        self.batches: Counter[str] = Counter()
        self.api_calls: Counter[str] = Counter()
        self.blocks = 0
        self.entries = 0

    def copy(self, stream, src_rows, dst_rows, src, dst, *, src_chunk=0, dst_chunk=0) -> str:
        assert isinstance(stream, FakeStream)
        dst_rows[torch.as_tensor(np.asarray(dst))] = src_rows[torch.as_tensor(np.asarray(src))]
        self.batches[self.path] += 1
        self.api_calls[self.path] += 1
        self.blocks += len(src)
        self.entries += len(src)
        return self.path

    def describe(self) -> dict:
        return {"path": self.path}


@pytest.fixture
def fake_cuda(monkeypatch):
    compute = FakeStream()
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(cuda_executor, "BatchCopier", FakeCopier)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    return compute


def _slow(pool: DiskPool, seed: int, delay_s: float | None = None) -> None:
    """Disk batches take a little while: ``delay_s``, or up to 2 ms in varying order
    (from their own random source: the copy stream stays the same whatever the
    threads do)."""
    write, read = pool.write_blocks, pool.read_blocks
    delays = random.Random(seed)

    def pause() -> None:
        time.sleep(delay_s if delay_s is not None else delays.random() * 0.002)

    def slow_write(slots, rows):
        pause()
        write(slots, rows)

    def slow_read(slots, rows):
        pause()
        read(slots, rows)
    pool.write_blocks, pool.read_blocks = slow_write, slow_read


def _pattern(tag: int) -> torch.Tensor:
    return ((torch.arange(LAYOUT.bytes_per_block) * 7 + tag * 13) % 251).to(torch.uint8)


@pytest.fixture
def tiers(fake_cuda, tmp_path):
    """``make(caps, delay_s, seed)``: CPU pools whose global slot g holds ``_pattern(g)``,
    slow disk I/O, and a CUDA executor over them; returns (pools, executor, content)."""
    made = []

    def make(caps: tuple[int, int, int], delay_s: float | None = None, seed: int = 0, groups: int = 1):
        gpu = GpuPool(LAYOUT, caps[0], torch.device("cpu"))
        host = HostPool(LAYOUT, caps[1], pin=False)
        disk = DiskPool(LAYOUT, caps[2], str(tmp_path), 0, io_threads=2)
        content = list(range(sum(caps)))  # the tag each global slot holds, replayed in order
        gpu.raw[:] = torch.stack([_pattern(t) for t in content[: caps[0]]])
        host.raw[:] = torch.stack([_pattern(t) for t in content[caps[0]: caps[0] + caps[1]]])
        disk.write_blocks(list(range(caps[2])), [_pattern(t) for t in content[caps[0] + caps[1]:]])
        _slow(disk, seed, delay_s)
        ex = cuda_executor.CudaExecutor(gpu, host, disk, torch.device("cpu"), disk_threads=2,
                                        groups=LAYOUT.layer_groups(groups))
        made.append((ex, disk, host))
        return (gpu, host, disk), ex, content
    yield make
    for ex, disk, host in made:
        ex.close()
        disk.close()
        host.close()


def _wrong(space: SlotSpace, pools, content: list[int]) -> list[int]:
    """Global slots whose bytes differ from the tag a sequential replay gives."""
    gpu, host, disk = pools
    n_disk = space.capacity[2]
    got_disk = [torch.empty(LAYOUT.bytes_per_block, dtype=torch.uint8) for _ in range(n_disk)]
    disk.read_blocks(list(range(n_disk)), got_disk)
    rows = list(gpu.raw) + list(host.raw) + got_disk
    return [g for g in range(space.total) if not torch.equal(rows[g], _pattern(content[g]))]


def test_a_write_waits_for_a_demotion_behind_a_second_read(tiers):
    """Host slot 0 is demoted to disk slot 0 (slowly), then onboarded to GPU slot 0 (a
    second read), then overwritten by an offload. The engine keeps one read entry per
    slot, so the offload waits for the onboard alone: the onboard must have waited for
    the demotion, or the demotion writes the offload's bytes to disk."""
    caps = (4, 4, 4)
    space = SlotSpace(caps)
    pools, ex, content = tiers(caps, delay_s=0.05)
    H, D = space.base[1], space.base[2]
    engine = TransferEngine(space, ex)
    engine.begin_step()
    for route, s, d in ((DEMOTE, H + 0, D + 0), (ONBOARD, H + 0, 0), (OFFLOAD, 1, H + 0)):
        engine.copy(route, s, d)
        content[d] = content[s]
    engine.before_compute()
    engine.synchronize()
    assert _wrong(space, pools, content) == []
    assert ex.counters.host_waits >= 1  # the onboard's wait for the demotion


@pytest.mark.parametrize("groups", [1, 4], ids=["whole", "by-layer"])
@pytest.mark.parametrize("seed", range(12))
def test_random_copies_leave_the_bytes_of_a_sequential_replay(tiers, seed, groups):
    rng = np.random.default_rng(seed)
    caps = (12, 16, 8)
    space = SlotSpace(caps)
    pools, ex, content = tiers(caps, seed=seed, groups=groups)
    engine = TransferEngine(space, ex)
    for _step in range(30):
        engine.begin_step()
        for _call in range(int(rng.integers(1, 5))):
            moves = _random_moves(rng, space, int(rng.integers(1, 7)))
            for _, s, d in moves:
                content[d] = content[s]
            _queue(engine, moves, bulk=rng.random() < 0.5)
        engine.before_compute(layered=ex.layered)
        for layer in range(LAYOUT.num_layers):  # S5 layer by layer: a reload's GPU half lands here
            engine.before_layer(layer)
        engine.check_invariants()
    engine.synchronize()
    wrong = _wrong(space, pools, content)
    assert wrong == [], f"slots {wrong} hold other bytes than a sequential replay gives"
    st = ex.stats()
    assert st["disk_batches"] > 0 and st["blocks"] > 0 and st["path"] == "fake"
    assert st["bounces_lent"] == 0, "a bounce buffer outlived its batch"
    assert not ex._inflight and not ex._unsettled


def test_a_reload_gives_its_bounce_back_while_an_earlier_demotion_is_still_writing(tiers):
    """Disk batches finish in any order: a reload's bounce buffer is free once the reload
    is done, not once every disk batch queued before it is (a slow demotion at the head
    would otherwise make every later reload allocate pinned memory of its own)."""
    caps = (4, 4, 4)
    (gpu, host, disk), ex, content = tiers(caps, delay_s=0.0)
    gate = threading.Event()
    write = disk.write_blocks

    def gated_write(slots, rows):
        assert gate.wait(10), "the gate was never opened"
        write(slots, rows)
    disk.write_blocks = gated_write
    reserved = ex.stats()["bounce_allocations"]  # allocated with the executor
    try:
        demotion = ex.submit(DEMOTE, [0], [0], [])
        reload = ex.submit(RELOAD, [1], [2], [])
        deadline = time.monotonic() + 10
        while not ex.is_done(reload):
            assert time.monotonic() < deadline, "the reload never finished"
            time.sleep(0.001)
        ex.record_compute()  # the executor tidies up on its next call
        st = ex.stats()
        assert not ex.is_done(demotion)
        assert st["bounces_lent"] == 0 and st["bounce_allocations"] == reserved
        assert torch.equal(gpu.raw[2], _pattern(content[sum(caps[:2]) + 1]))
        for slot in (2, 3, 0):  # one after the other: each takes a buffer given back
            ex.wait_host([ex.submit(RELOAD, [slot], [3], [])])
            ex.record_compute()
        assert ex.stats()["bounce_allocations"] == reserved
    finally:
        gate.set()
    ex.synchronize()
    assert ex.stats()["bounces_lent"] == 0


def test_polling_a_promotion_never_waits_for_its_read(tiers):
    """A prefetch's promotion (disk -> host) reads on a worker: ``poll`` answers at once
    while the read is held (no host wait counted), True once it ran; the onboard that
    follows it then waits for nothing on the host. With ``poll`` waiting for the read
    (``is_done`` replaced by ``wait_host``) the held read would hang it, and the gate's
    assertion fails instead."""
    caps = (4, 4, 4)
    (gpu, host, disk), ex, content = tiers(caps, delay_s=0.0)
    gate, done = threading.Event(), threading.Event()
    read = disk.read_blocks

    def gated_read(slots, rows):
        assert gate.wait(10), "the gate was never opened"
        read(slots, rows)
        done.set()
    disk.read_blocks = gated_read
    try:
        promotion = ex.submit(PROMOTE, [2], [1], [])
        assert ex.background_disk
        for _ in range(3):  # steps go on: each asks, none waits
            assert ex.poll([promotion]) is False
        assert ex.counters.host_waits == 0
    finally:
        gate.set()
    assert done.wait(10)
    deadline = time.monotonic() + 10
    while not ex.poll([promotion]):
        assert time.monotonic() < deadline, "the promotion never finished"
        time.sleep(0.001)
    ex.submit(ONBOARD, [1], [0], [promotion])
    assert ex.counters.host_waits == 0  # its read was done: the onboard's S2 wait is none
    ex.synchronize()
    assert torch.equal(gpu.raw[0], _pattern(content[sum(caps[:2]) + 2]))
