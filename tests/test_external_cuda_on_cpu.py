"""``ExternalCudaExecutor``'s own logic on a machine without CUDA: its two ways of moving
a block as the pieces vLLM's tensors hold it — ``direct`` (an entry a piece; the stand-in
copier copies each by address, so the pointer arithmetic is checked byte for byte) and
``staged`` (whole blocks through a staging buffer, half of it a chunk, pieces scattered
and gathered by kernels on a side stream), and ``rows`` (whole blocks where the layers of
a block are adjacent) — under random copies of every route through the transfer engine,
whole and by layer group, small staging buffers (several chunks a batch). Every slot must end
with the bytes a sequential replay gives. CUDA streams and events are stand-ins whose
copies run at once (``test_cuda_executor_on_cpu``)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from kvdist.blocks import SlotSpace
from kvdist.external import ExternalGpuTier
from kvdist.external.cuda import STAGED_BELOW, ExternalCudaExecutor
from kvdist.layout import KVLayout
from kvdist.storage import DiskPool, HostPool
from kvdist.transfer import TransferEngine
from kvdist.transfer import cuda as cuda_executor

from .external_kv import DTYPE, D, H, L, T, vllm_kv
from .test_cuda_executor_on_cpu import FakeCopier, FakeEvent, FakeStream
from .test_transfer_engine import _queue, _random_moves

LAYOUT = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype=DTYPE, tokens_per_block=T)
BPB = LAYOUT.bytes_per_block


class PointerCopier(FakeCopier):
    """The stand-in copier, also by address (the direct path's pieces)."""

    def copy_pointers(self, stream, dsts, srcs, sizes) -> str:
        assert isinstance(stream, FakeStream)
        for d, s, k in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            ctypes.memmove(d, s, k)
        self.entries += len(sizes)
        self.api_calls[self.path] += 1
        return self.path


class Stream(FakeStream):
    """A stand-in stream that can also wait for another (the staged path's side streams)."""

    def wait_stream(self, other) -> None:
        assert isinstance(other, FakeStream), f"a stream waits for {other!r}"


@pytest.fixture
def fake_cuda(monkeypatch):
    compute = FakeStream()
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(cuda_executor, "BatchCopier", PointerCopier)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    return compute


def _pattern(tag: int) -> torch.Tensor:
    return ((torch.arange(BPB) * 7 + tag * 13) % 251).to(torch.uint8)


def _engine_rows(gpu: ExternalGpuTier) -> torch.Tensor:
    """Every engine block as kvdist block bytes (the pieces in order)."""
    rows = torch.empty((gpu.num_blocks, BPB), dtype=torch.uint8)
    gpu.gather(torch.arange(gpu.num_blocks), rows, range(L), at=torch.arange(gpu.num_blocks))
    return rows


@pytest.mark.parametrize("groups", [1, L], ids=["whole", "by-layer"])
@pytest.mark.parametrize("gather,order", [(g, o) for g in ("direct", "staged")
                                          for o in ("LBNHC", "separate", "BLNHC")] + [("rows", "BLNHC")])
@pytest.mark.parametrize("seed", range(2))
def test_random_copies_leave_the_bytes_of_a_sequential_replay(fake_cuda, tmp_path, seed, gather, groups,
                                                              order):
    rng = np.random.default_rng(seed)
    caps = (10, 12, 6)
    space = SlotSpace(caps)
    gpu = ExternalGpuTier(LAYOUT, vllm_kv(caps[0], order))
    assert gpu.stacked == (order != "separate") and (gpu.rows is not None) == (order == "BLNHC")
    host = HostPool(LAYOUT, caps[1], pin=False)
    disk = DiskPool(LAYOUT, caps[2], str(tmp_path), 0, io_threads=2)
    content = list(range(space.total))  # the tag each global slot holds
    gpu.scatter(torch.stack([_pattern(t) for t in content[:caps[0]]]), torch.arange(caps[0]), range(L))
    host.raw[:] = torch.stack([_pattern(t) for t in content[caps[0]:caps[0] + caps[1]]])
    disk.write_blocks(list(range(caps[2])), [_pattern(t) for t in content[caps[0] + caps[1]:]])
    ex = ExternalCudaExecutor(gpu, host, disk, torch.device("cpu"), groups=LAYOUT.layer_groups(groups),
                              gather=gather, stage_bytes=3 * BPB)
    try:
        assert ex.gather == gather and ex.stats()["gather"] == gather
        engine = TransferEngine(space, ex)
        for _step in range(20):
            engine.begin_step()
            for _call in range(int(rng.integers(1, 4))):
                moves = _random_moves(rng, space, int(rng.integers(1, 8)))
                for _, s, d in moves:
                    content[d] = content[s]
                _queue(engine, moves, bulk=rng.random() < 0.5)
            engine.before_compute(layered=ex.layered)
            for layer in range(L):
                engine.before_layer(layer)
        engine.synchronize()
        got_disk = [torch.empty(BPB, dtype=torch.uint8) for _ in range(caps[2])]
        disk.read_blocks(list(range(caps[2])), got_disk)
        rows = list(_engine_rows(gpu)) + list(host.raw) + got_disk
        wrong = [g for g in range(space.total) if not torch.equal(rows[g], _pattern(content[g]))]
        assert wrong == [], f"slots {wrong} hold other bytes than a sequential replay gives"
        assert ex.stats()["bounces_lent"] == 0
    finally:
        ex.close()
        disk.close()
        host.close()


def test_auto_stages_pieces_smaller_than_the_copy_engines_full_rate(fake_cuda):
    gpu = ExternalGpuTier(LAYOUT, vllm_kv(4))
    piece = gpu.pieces_of.piece_bytes
    assert piece == BPB // L and piece < STAGED_BELOW
    assert ExternalCudaExecutor(gpu, None, None, torch.device("cpu")).gather == "staged"
    staged = ExternalCudaExecutor(gpu, None, None, torch.device("cpu"), staged_below=piece + 1)
    direct = ExternalCudaExecutor(gpu, None, None, torch.device("cpu"), staged_below=piece)
    assert (staged.gather, direct.gather) == ("staged", "direct")
    rows = ExternalCudaExecutor(ExternalGpuTier(LAYOUT, vllm_kv(4, "BLNHC")), None, None, torch.device("cpu"))
    assert rows.gather == "rows"



PROMPT = list(range(100, 100 + 5 * T + 1))  # five full blocks and one token


def failed_disk_read(kv: list[torch.Tensor], cfg: dict, gather: str, monkeypatch, on_device) -> None:
    """A load of five blocks, three from kvdist's disk tier and two from its host tier,
    whose disk read fails (the read wrote some bytes into its buffer, then raised): the
    three engine blocks of that read keep their bytes and are reported failed, the two
    host blocks land, the load is reported finished, nothing raises, no buffer is left
    lent; the next load of the same blocks, the disk healthy again, lands them all.
    ``on_device()``: the host waits for the compute stream (CUDA) or nothing (stand-ins)."""
    from kvdist.external import ExternalPlanner, create

    from .external_kv import snapshot

    worker = create(cfg, device=kv[0].device)
    try:
        worker.register({f"model.layers.{i}.self_attn": t for i, t in enumerate(kv)}, gather=gather)
        assert worker.executor.stats()["gather"] == gather
        planner = ExternalPlanner(cfg, worker.tier_plan)
        before = snapshot([t.cpu() for t in kv])
        planner.plan_save("a", PROMPT, [1, 2, 3, 4, 5])  # two host blocks: the three oldest go to disk
        worker.start(planner.take())
        worker.synchronize()
        assert planner.stats()["blocks_used"] == {"host": 2, "disk": 3}
        read = DiskPool.read_blocks

        def broken(self, slots, rows):
            rows[0][:] = 0xFF  # some bytes arrived, then the I/O error
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(DiskPool, "read_blocks", broken)
        planner.plan_load("b", PROMPT, [6, 7, 8, 9, 10])
        transfers = planner.take()
        assert [r.name for r in transfers.routes()] == ["reload"] * 3 + ["onboard"] * 2
        worker.start(transfers)
        for layer in range(L):
            worker.wait_layer(layer)
        on_device()
        assert worker.finished().loaded == {"b"}
        assert worker.failed_blocks() == {6, 7, 8}
        worker.synchronize()
        assert worker.failed_blocks() == set()
        now = snapshot([t.cpu() for t in kv])
        moved = {9: 4, 10: 5}  # engine blocks 6, 7 and 8 as they were
        for layer in range(L):
            for b in range(len(now[layer])):
                assert torch.equal(now[layer][b], before[layer][moved.get(b, b)]), (layer, b)
        assert worker.executor.stats()["bounces_lent"] == 0
        monkeypatch.setattr(DiskPool, "read_blocks", read)
        planner.plan_load("c", PROMPT, [6, 7, 8, 11, 0])
        worker.start(planner.take())
        for layer in range(L):
            worker.wait_layer(layer)
        on_device()
        worker.synchronize()
        assert worker.finished().loaded == {"c"} and worker.failed_blocks() == set()
        now = snapshot([t.cpu() for t in kv])
        moved = {6: 1, 7: 2, 8: 3, 9: 4, 10: 5, 11: 4, 0: 5}
        for layer in range(L):
            for b in range(len(now[layer])):
                assert torch.equal(now[layer][b], before[layer][moved.get(b, b)]), (layer, b)
        worker.check_invariants()
    finally:
        worker.close()


@pytest.mark.parametrize("groups", [1, L], ids=["whole", "by-layer"])
@pytest.mark.parametrize("gather,order", [("direct", "separate"), ("staged", "separate"), ("staged", "LBNHC"),
                                          ("rows", "BLNHC")])
def test_a_failed_disk_read_on_the_cuda_executor_reports_its_blocks_and_the_step_goes_on(
        fake_cuda, monkeypatch, tmp_path, gather, order, groups):
    """The CUDA executor's handling of a failed disk read (``ExternalCudaExecutor``,
    through ``ExternalCache``) with stand-in streams; ``test_external_cuda`` runs the
    same on a GPU."""
    from kvdist.external import cache as external_cache

    from .external_kv import config

    monkeypatch.setattr(external_cache, "_on_cuda", lambda gpu: True)
    cfg = config(host_blocks=2, disk_blocks=8, disk_path=str(tmp_path), layer_groups=groups)
    failed_disk_read(vllm_kv(12, order), cfg, gather, monkeypatch, lambda: None)


def test_a_failed_reload_still_orders_what_follows_it_after_what_it_followed(fake_cuda, monkeypatch,
                                                                            tmp_path):
    """A failed reload copies nothing, but the transfer engine takes it for the last
    write of its engine blocks and drops their pending reads (S2): its event on the
    onboard stream must follow what its GPU half would have waited for (here an
    offload still reading the block)."""
    from kvdist.transfer import OFFLOAD, ONBOARD, RELOAD

    gpu = ExternalGpuTier(LAYOUT, vllm_kv(4))
    host = HostPool(LAYOUT, 2, pin=False)
    disk = DiskPool(LAYOUT, 2, str(tmp_path), 0, io_threads=1)
    failed: list[int] = []
    ex = ExternalCudaExecutor(gpu, host, disk, torch.device("cpu"), gather="direct", on_failed=failed.extend)
    try:
        offload = ex.submit(OFFLOAD, np.array([3]), np.array([0]), [])

        def broken(self, slots, rows):
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(DiskPool, "read_blocks", broken)
        reload = ex.submit(RELOAD, np.array([1]), np.array([3]), [offload])
        reload.future.result()
        assert ex.is_done(reload) and failed == [3]
        onboard = ex.streams[ONBOARD.stream]
        assert onboard.waited == [offload]  # before its event was recorded there
        assert reload.gpu_event is not None and not reload.gpu_pending
        ex.synchronize()
        assert failed == [3] and ex.stats()["bounces_lent"] == 0
    finally:
        ex.close()
        disk.close()
        host.close()


def test_the_staged_path_uploads_a_batchs_ids_once_and_alternates_halves_across_batches(fake_cuda,
                                                                                       monkeypatch):
    """By layer group, a staged batch's engine block ids go to the device once, not once
    a group; a batch's first chunk goes through the staging half the last batch did not
    end in, so its copy need not wait for the last batch's kernel."""
    from kvdist.transfer import ONBOARD

    gpu = ExternalGpuTier(LAYOUT, vllm_kv(8, "separate"))
    host = HostPool(LAYOUT, 8, pin=False)
    host.raw[:] = torch.stack([_pattern(t) for t in range(8)])
    for groups, batches in ((L, [[0, 1]]), (1, [[2], [3], [4]])):
        ex = ExternalCudaExecutor(gpu, host, None, torch.device("cpu"), groups=LAYOUT.layer_groups(groups),
                                  gather="staged", stage_bytes=2 * BPB)  # a half holds one block
        into: list[int] = []
        copy = ex.copier.copy

        def spy(stream, src_rows, dst_rows, s, d, copy=copy, into=into, **chunks):
            into.append(dst_rows.data_ptr())
            return copy(stream, src_rows, dst_rows, s, d, **chunks)

        monkeypatch.setattr(ex.copier, "copy", spy)
        try:
            for b in batches:
                ex.submit(ONBOARD, np.array(b), np.array(b) + 3, [])
            assert ex.index_uploads() == len(batches)
            if groups == 1:  # three batches of one chunk: halves 0, 1, 0
                assert into[0] == into[2] != into[1]
            ex.synchronize()
            for b in sum(batches, []):
                assert torch.equal(_engine_rows(gpu)[b + 3], _pattern(b))
        finally:
            ex.close()
    host.close()


def test_the_staged_paths_id_uploads_never_wait_for_the_other_direction(fake_cuda, monkeypatch):
    """Each copy stream stages its block ids through a ring of its own: with every
    offload still in flight, an onboard's upload never waits for an offload's (one
    ring for both would, once the offloads had gone round it)."""
    from kvdist.external import cuda as external_cuda
    from kvdist.staging import ImmediateH2D
    from kvdist.transfer import OFFLOAD, ONBOARD

    waited: list = []

    class Pending(ImmediateH2D):
        """Uploads whose marker (the stream) never completes; waits are recorded."""

        def to_device(self, src, stream=None, reuse=None):
            return super().to_device(src, stream)[0], stream

        @staticmethod
        def is_done(marker) -> bool:
            return marker is None

        @staticmethod
        def wait(marker) -> None:
            waited.append(marker)

    monkeypatch.setattr(external_cuda, "ImmediateH2D", Pending)
    gpu = ExternalGpuTier(LAYOUT, vllm_kv(4, "separate"))
    host = HostPool(LAYOUT, 4, pin=False)
    ex = ExternalCudaExecutor(gpu, host, None, torch.device("cpu"), gather="staged")
    try:
        for _ in range(external_cuda.INDEX_SLOTS):
            ex.submit(OFFLOAD, np.array([0]), np.array([0]), [])
        ex.submit(ONBOARD, np.array([1]), np.array([1]), [])
        assert waited == []
        ex.submit(OFFLOAD, np.array([0]), np.array([0]), [])
        assert waited == [ex.streams[OFFLOAD.stream]]  # its own ring, gone round: it waits
    finally:
        ex.close()
        host.close()


@pytest.mark.parametrize("order", ["separate", "LBNHC"])
def test_a_layer_groups_staged_chunk_fills_half_the_buffer(fake_cuda, order):
    """By layer group, the staging buffer holds a group's bytes of as many blocks as fit
    (here half the buffer: one whole block, or three of one layer's bytes), not one whole
    block's room a block: a batch of six blocks by layer is two chunks a layer, six
    copies in all, not eighteen."""
    from kvdist.transfer import OFFLOAD, ONBOARD

    gpu = ExternalGpuTier(LAYOUT, vllm_kv(8, order))
    host = HostPool(LAYOUT, 8, pin=False)
    host.raw[:] = torch.stack([_pattern(t) for t in range(8)])
    ex = ExternalCudaExecutor(gpu, host, None, torch.device("cpu"), groups=LAYOUT.layer_groups(L),
                              gather="staged", stage_bytes=2 * BPB)
    try:
        calls = ex.copier.api_calls[ex.copier.path]
        ex.submit(ONBOARD, np.arange(6), np.arange(6) + 2, [])
        assert ex.copier.api_calls[ex.copier.path] - calls == 2 * L
        ex.synchronize()
        rows = _engine_rows(gpu)
        assert all(torch.equal(rows[b + 2], _pattern(b)) for b in range(6))
        ex.submit(OFFLOAD, np.arange(2, 8), np.array([7, 6, 5, 4, 3, 2]), [])
        assert ex.copier.api_calls[ex.copier.path] - calls == 4 * L
        ex.synchronize()
        assert all(torch.equal(host.raw[7 - b], rows[b + 2]) for b in range(6))
    finally:
        ex.close()
        host.close()
