"""The CUDA executor's own logic on a machine without CUDA: its per-route handlers, the
disk batches on worker threads (demote, spill, fetch with their bounce buffers and
GPU halves), the host waits, ``compute_wait``, ``synchronize``, ``is_done`` and
``stats``, with CUDA streams and events replaced by stand-ins whose copies run at
once on CPU tensors. Random copy streams through the transfer engine must leave
every slot with the bytes a sequential replay gives; disk I/O is slowed down so a
missing wait for a worker shows up as wrong bytes.

What this cannot see: the GPU running behind the host (every stand-in copy is done
when submitted). ``test_transfer_cuda.py`` covers that on a real GPU."""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest
import torch

from kvdist.blocks import SlotSpace
from kvdist.layout import KVLayout
from kvdist.storage import DiskPool, GpuPool, HostPool
from kvdist.transfer import cuda as cuda_executor
from kvdist.transfer.engine import TransferEngine

from .test_transfer_engine import _queue, _random_moves

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, dtype="uint8", tokens_per_block=4)


class FakeEvent:
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

    def copy(self, stream, src_rows, dst_rows, src, dst, *, src_chunk=0, dst_chunk=0) -> str:
        assert isinstance(stream, FakeStream)
        dst_rows[torch.as_tensor(np.asarray(dst))] = src_rows[torch.as_tensor(np.asarray(src))]
        self.batches[self.path] += 1
        self.api_calls[self.path] += 1
        self.blocks += len(src)
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


def _slow(pool: DiskPool, rng: np.random.Generator) -> None:
    """Disk batches take a little while, in varying order."""
    write, read = pool.write_blocks, pool.read_blocks

    def slow_write(slots, rows):
        time.sleep(float(rng.random()) * 0.002)
        write(slots, rows)

    def slow_read(slots, rows):
        time.sleep(float(rng.random()) * 0.002)
        read(slots, rows)
    pool.write_blocks, pool.read_blocks = slow_write, slow_read


def _pattern(tag: int) -> torch.Tensor:
    return ((torch.arange(LAYOUT.bytes_per_block) * 7 + tag * 13) % 251).to(torch.uint8)


@pytest.mark.parametrize("seed", range(3))
def test_random_copies_leave_the_bytes_of_a_sequential_replay(fake_cuda, tmp_path, seed):
    rng = np.random.default_rng(seed)
    caps = (12, 16, 8)
    space = SlotSpace(caps)
    gpu = GpuPool(LAYOUT, caps[0], torch.device("cpu"))
    host = HostPool(LAYOUT, caps[1], pin=False)
    disk = DiskPool(LAYOUT, caps[2], str(tmp_path), 0, io_threads=2)
    ex = cuda_executor.CudaExecutor(gpu, host, disk, torch.device("cpu"), disk_threads=2)
    try:
        _slow(disk, rng)
        content = list(range(space.total))  # the tag each global slot holds, replayed in order
        gpu.raw[:] = torch.stack([_pattern(t) for t in content[: caps[0]]])
        host.raw[:] = torch.stack([_pattern(t) for t in content[caps[0]: caps[0] + caps[1]]])
        disk.write_blocks(list(range(caps[2])), [_pattern(t) for t in content[caps[0] + caps[1]:]])
        engine = TransferEngine(space, ex)
        for _step in range(30):
            engine.begin_step()
            for _call in range(int(rng.integers(1, 5))):
                moves = _random_moves(rng, space, int(rng.integers(1, 7)))
                for _, s, d in moves:
                    content[d] = content[s]
                _queue(engine, moves, bulk=rng.random() < 0.5)
            engine.before_compute()
            engine.check_invariants()
        engine.synchronize()
        got_disk = [torch.empty(LAYOUT.bytes_per_block, dtype=torch.uint8) for _ in range(caps[2])]
        disk.read_blocks(list(range(caps[2])), got_disk)
        rows = list(gpu.raw) + list(host.raw) + got_disk
        wrong = [g for g in range(space.total) if not torch.equal(rows[g], _pattern(content[g]))]
        assert wrong == [], f"slots {wrong} hold other bytes than a sequential replay gives"
        st = ex.stats()
        assert st["disk_batches"] > 0 and st["blocks"] > 0 and st["path"] == "fake"
        assert not ex._inflight and not ex._unsettled
    finally:
        ex.close()
        disk.close()
        host.close()
