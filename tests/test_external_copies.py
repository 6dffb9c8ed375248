"""``ExternalCopies``, the CPU handlers of every route with the engine's tensors as the
GPU tier (the ``SyncExecutor`` and ``SimExecutor`` run them), under the lazy, adversarial
simulated streams: random copies through the transfer engine, whole and by layer group,
forced only when something follows them, must leave every slot with the bytes a
sequential replay gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvdist.blocks import SlotSpace
from kvdist.external import ExternalGpuTier
from kvdist.external.copies import ExternalCopies
from kvdist.storage import DiskPool, HostPool
from kvdist.transfer import SimExecutor, TransferEngine

from .external_kv import L, vllm_kv
from .test_external_cuda_on_cpu import BPB, LAYOUT, _engine_rows, _pattern
from .test_transfer_engine import _queue, _random_moves


@pytest.mark.parametrize("groups", [1, L], ids=["whole", "by-layer"])
@pytest.mark.parametrize("order", ["LBNHC", "separate"])
@pytest.mark.parametrize("seed", range(2))
def test_random_copies_under_simulated_streams_leave_the_bytes_of_a_sequential_replay(tmp_path, seed, order,
                                                                                     groups):
    rng = np.random.default_rng(seed)
    caps = (10, 12, 6)
    space = SlotSpace(caps)
    gpu = ExternalGpuTier(LAYOUT, vllm_kv(caps[0], order))
    host = HostPool(LAYOUT, caps[1], pin=False)
    disk = DiskPool(LAYOUT, caps[2], str(tmp_path), 0, io_threads=2)
    content = list(range(space.total))
    gpu.scatter(torch.stack([_pattern(t) for t in content[:caps[0]]]), torch.arange(caps[0]), range(L))
    host.raw[:] = torch.stack([_pattern(t) for t in content[caps[0]:caps[0] + caps[1]]])
    disk.write_blocks(list(range(caps[2])), [_pattern(t) for t in content[caps[0] + caps[1]:]])
    ex = SimExecutor(ExternalCopies(gpu, host, disk), groups=LAYOUT.layer_groups(groups))
    try:
        engine = TransferEngine(space, ex)
        for _step in range(20):
            engine.begin_step()
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
        assert [g for g in range(space.total) if not torch.equal(rows[g], _pattern(content[g]))] == []
    finally:
        disk.close()
        host.close()
