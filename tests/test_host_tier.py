"""The host tier: chunked registration and its teardown (also after a failure in the
middle), prefaulting, failure mapping for each limit, and ``host.bytes: auto``.

Registration runs through an injected fake registrar, so all of it runs on CPU."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap

import pytest
import torch

import kvdist
from kvdist.candidate import plan_capacity
from kvdist.errors import HostTierUnavailable
from kvdist.layout import KVLayout
from kvdist.storage import host as host_mod
from kvdist.storage import host_sizing
from kvdist.storage.host import HostMemory, HostPool
from kvdist.storage.host_sizing import HostLimits, auto_host_bytes
from kvdist.storage.pinning import RegistrationError

from .conftest import make_cfg

GiB = 1 << 30
PLENTY = HostLimits(available=1 << 50, memlock=None)
# 768-byte blocks: lcm(768, 4096) = 12288, so a 64 KiB chunk holds 61440 bytes = 80 blocks.
ODD = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float16", tokens_per_block=4)


class FakeRegistrar:
    """Counts live registrations; fails the ``fail_on``-th register call (0-based) and
    the ``fail_unregister_on``-th unregister call."""

    name = "fake"

    def __init__(self, fail_on: int | None = None, fail_unregister_on: int | None = None):
        self.fail_on, self.fail_unregister_on = fail_on, fail_unregister_on
        self.live: dict[int, int] = {}
        self.registers: list[tuple[int, int]] = []
        self.unregisters: list[int] = []

    def register(self, ptr: int, nbytes: int) -> None:
        if len(self.registers) == self.fail_on:
            self.registers.append((ptr, -1))
            raise RegistrationError("cudaHostRegister failed: out of memory (error 2)")
        assert not any(p <= ptr < p + n or ptr <= p < ptr + nbytes for p, n in self.live.items()), \
            "overlapping registration"
        self.registers.append((ptr, nbytes))
        self.live[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        assert ptr in self.live, f"unregister of {ptr:#x}, which is not registered"
        self.unregisters.append(ptr)
        del self.live[ptr]
        if len(self.unregisters) - 1 == self.fail_unregister_on:
            raise RegistrationError("cudaHostUnregister failed: injected")


def mapped(addr: int, nbytes: int) -> bool:
    """Whether any part of [addr, addr + nbytes) is mapped in this process."""
    with open("/proc/self/maps", encoding="utf-8") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo < addr + nbytes and addr < hi:
                return True
    return False


_libc = ctypes.CDLL(None, use_errno=True)


def resident_fraction(addr: int, nbytes: int) -> float:
    pages = -(-nbytes // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    assert _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), vec) == 0
    return sum(v & 1 for v in vec) / pages


def pool(registrar=None, num_blocks=500, chunk=64 << 10, limits=PLENTY, **kw) -> HostPool:
    return HostPool(ODD, num_blocks, pin=registrar is not None, registrar=registrar,
                    chunk_bytes=chunk, limits=limits, progress=False, **kw)


# -- chunked registration and teardown ------------------------------------------------------
def test_chunks_cover_the_memory_on_block_and_page_boundaries():
    fake = FakeRegistrar()
    p = pool(fake)
    addr, n = p.memory.addr, p.nbytes
    try:
        p.check_invariants()
        assert n == 500 * 768 == 384000
        assert p.memory.chunks == [(k * 61440, 61440) for k in range(6)] + [(368640, 15360)]
        assert fake.registers == [(addr + o, s) for o, s in p.memory.chunks]
        assert p.pinned and p.chunk_blocks == 80 and addr % mmap.PAGESIZE == 0
        assert p.memory.timings.chunks == 7 and p.memory.timings.longest_call_s >= 0
        assert p.raw.shape == (500, 768) and p.raw.dtype == torch.uint8
        assert int(p.raw.sum()) == 0
        p.raw[499] = 7
        assert int(p.raw.view(-1)[-768:].sum()) == 7 * 768
    finally:
        p.close()
    assert fake.live == {} and len(fake.unregisters) == 7
    assert fake.unregisters == [addr + o for o, _ in reversed(p.memory.chunks)]
    assert not mapped(addr, n)
    p.check_invariants()
    p.close()  # idempotent
    assert len(fake.unregisters) == 7


def test_chunk_smaller_than_the_alignment_unit_takes_one_unit():
    fake = FakeRegistrar()
    p = pool(fake, num_blocks=40, chunk=1000)
    try:
        assert p.memory.chunks == [(0, 12288), (12288, 12288), (24576, 6144)]
        assert p.chunk_blocks == 16
    finally:
        p.close()


@pytest.mark.parametrize("fail_on", [0, 3, 6])
def test_registration_failure_in_the_middle_undoes_everything(fail_on):
    fake = FakeRegistrar(fail_on=fail_on)
    with pytest.raises(HostTierUnavailable) as info:
        pool(fake)
    msg = str(info.value)
    assert f"chunk {fail_on} of 7" in msg and "384000 bytes" in msg
    assert "limit hit: CUDA host registration" in msg and "out of memory" in msg
    assert fake.live == {}
    assert len(fake.unregisters) == fail_on
    addr = fake.registers[0][0]
    assert not mapped(addr, 384000)


def test_unregister_failure_at_close_still_undoes_the_rest_and_unmaps():
    fake = FakeRegistrar(fail_unregister_on=1)
    p = pool(fake)
    addr = p.memory.addr
    with pytest.raises(RegistrationError, match="injected"):
        p.close()
    assert fake.live == {} and len(fake.unregisters) == 7
    assert not mapped(addr, p.nbytes)


def test_a_view_outliving_close_stays_readable_and_unmaps_when_dropped(caplog):
    fake = FakeRegistrar()
    p = pool(fake)
    addr, n = p.memory.addr, p.nbytes
    view = p.raw[3:5]
    view.fill_(9)
    caplog.set_level(logging.DEBUG, logger="kvdist.host")
    p.close()
    assert fake.live == {} and "still referenced at close" in caplog.text
    # Nothing is wrong (the view unmaps it when dropped): a debug line, not a warning.
    assert all(r.levelno == logging.DEBUG for r in caplog.records if "still referenced" in r.message)
    assert mapped(addr, n) and int(view.sum()) == 9 * 2 * 768  # no use-after-unmap
    del view
    assert not mapped(addr, n)


def test_plain_memory_is_not_registered_and_ignores_memlock():
    p = pool(None, limits=HostLimits(available=1 << 40, memlock=4096))
    try:
        assert not p.pinned and p.memory.registered == []
        p.check_invariants()
    finally:
        p.close()


# -- prefaulting ------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["madvise", "touch"])
def test_prefault_makes_every_page_resident(method):
    n = 8 << 20
    control = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE)
    caddr = ctypes.addressof(ctypes.c_char.from_buffer(control))
    try:
        # The check can fail: a fresh mapping has no resident page.
        assert resident_fraction(caddr, n) == 0.0
    finally:
        del caddr
    mem = HostMemory(n, threads=4, limits=PLENTY, prefault=method, huge_pages=False, progress=False)
    try:
        assert mem.timings.method == method
        assert resident_fraction(mem.addr, n) == 1.0
        assert int(mem.flat.sum()) == 0
    finally:
        mem.close()


def test_auto_prefault_falls_back_to_touching_where_the_kernel_lacks_populate(monkeypatch):
    real = host_mod._madvise
    monkeypatch.setattr(host_mod, "_madvise", lambda a, n, adv: errno.EINVAL
                        if adv == host_mod.MADV_POPULATE_WRITE else real(a, n, adv))
    mem = HostMemory(4 << 20, threads=2, limits=PLENTY, progress=False)
    try:
        assert mem.timings.method == "touch"
        assert resident_fraction(mem.addr, 4 << 20) == 1.0
    finally:
        mem.close()


# -- failure mapping, one limit at a time -------------------------------------------------------
def test_memlock_too_low_is_host_tier_unavailable_before_anything_is_registered():
    fake = FakeRegistrar()
    with pytest.raises(HostTierUnavailable) as info:
        pool(fake, limits=HostLimits(available=1 << 40, memlock=65536))
    msg = str(info.value)
    assert "384000 bytes" in msg and "65536 bytes" in msg and "limit hit: memlock" in msg
    assert fake.registers == []
    # The operator's way out where the driver does not charge the limit.
    p = pool(fake, limits=HostLimits(available=1 << 40, memlock=65536), check_memlock=False)
    p.close()
    assert len(fake.registers) == 7 and fake.live == {}


def test_more_than_the_node_has_is_host_tier_unavailable():
    fake = FakeRegistrar()
    with pytest.raises(HostTierUnavailable) as info:
        pool(fake, limits=HostLimits(available=300000, memlock=None))
    msg = str(info.value)
    assert "384000 bytes" in msg and "300000 bytes" in msg and "limit hit: available memory" in msg
    assert fake.registers == []


def test_mmap_enomem_is_host_tier_unavailable():
    # 1 PiB exceeds the 47-bit user address space: mmap says ENOMEM on any setting.
    with pytest.raises(HostTierUnavailable, match="limit hit: mmap") as info:
        HostMemory(1 << 50, limits=PLENTY, progress=False)
    assert str(1 << 50) in str(info.value)


def _failing_populate(monkeypatch, err: int, on_call: int) -> list[tuple[int, int]]:
    real, calls = host_mod._madvise, []

    def fake(addr, n, advice):
        if advice != host_mod.MADV_POPULATE_WRITE:
            return real(addr, n, advice)
        calls.append((addr, n))
        return err if len(calls) == on_call else real(addr, n, advice)
    monkeypatch.setattr(host_mod, "_madvise", fake)
    return calls


def test_prefault_enomem_is_host_tier_unavailable_and_undoes_registrations(monkeypatch):
    calls = _failing_populate(monkeypatch, errno.ENOMEM, on_call=6)
    fake = FakeRegistrar()
    with pytest.raises(HostTierUnavailable, match="limit hit: memory") as info:
        pool(fake, num_blocks=4000, chunk=256 << 10, prefault_threads=1)
    assert "3072000 bytes" in str(info.value)
    assert fake.registers and fake.live == {}
    assert not mapped(calls[0][0], 3072000)


def test_other_prefault_errors_stay_generic(monkeypatch):
    calls = _failing_populate(monkeypatch, errno.EPERM, on_call=4)
    fake = FakeRegistrar()
    with pytest.raises(OSError) as info:
        pool(fake, num_blocks=4000, chunk=256 << 10, prefault_threads=1)
    assert not isinstance(info.value, kvdist.KVDistError) and info.value.errno == errno.EPERM
    assert fake.live == {} and not mapped(calls[0][0], 3072000)


# -- host.bytes: auto ------------------------------------------------------------------------------
def limits(avail_gib: float, memlock_gib: float | None = None) -> HostLimits:
    return HostLimits(int(avail_gib * GiB), None if memlock_gib is None else int(memlock_gib * GiB))


@pytest.mark.parametrize("ranks, want", [(1, 32 * GiB), (2, 16 * GiB), (4, 8 * GiB), (8, 4 * GiB)])
def test_auto_shares_the_node_memory_among_its_ranks(ranks, want):
    s = auto_host_bytes(100 * GiB, ranks, memory_fraction=0.5, gpu_ratio=4.0, pinned=True,
                        limits=limits(64))
    assert (s.nbytes, s.bound) == (want, "memory")
    assert s.bounds == {"memory": want, "gpu": 400 * GiB}
    assert "bound by memory" in s.describe()


def test_auto_is_bound_by_memlock_only_when_pinned_and_checked():
    kw = dict(memory_fraction=0.5, gpu_ratio=4.0, limits=limits(64, memlock_gib=10))
    s = auto_host_bytes(100 * GiB, 1, pinned=True, **kw)
    assert (s.nbytes, s.bound) == (int(10 * GiB * 0.8), "memlock")
    assert auto_host_bytes(100 * GiB, 1, pinned=False, **kw).bound == "memory"
    assert auto_host_bytes(100 * GiB, 1, pinned=True, check_memlock=False, **kw).bound == "memory"


def test_auto_is_bound_by_the_gpu_tier():
    s = auto_host_bytes(2 * GiB, 2, memory_fraction=0.5, gpu_ratio=4.0, pinned=True, limits=limits(64))
    assert (s.nbytes, s.bound) == (8 * GiB, "gpu")


def test_memlock_limit_does_not_bind_when_unlimited_or_with_cap_ipc_lock(monkeypatch):
    monkeypatch.setattr(host_sizing.resource, "getrlimit", lambda what: (65536, 65536))
    monkeypatch.setattr(host_sizing, "has_ipc_lock", lambda: False)
    assert host_sizing.memlock_limit() == 65536
    monkeypatch.setattr(host_sizing, "has_ipc_lock", lambda: True)
    assert host_sizing.memlock_limit() is None
    monkeypatch.setattr(host_sizing, "has_ipc_lock", lambda: False)
    monkeypatch.setattr(host_sizing.resource, "getrlimit",
                        lambda what: (host_sizing.resource.RLIM_INFINITY,) * 2)
    assert host_sizing.memlock_limit() is None


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_plan_capacity_host_auto_uses_the_per_rank_share(monkeypatch, ranks):
    monkeypatch.setattr(host_sizing, "read_limits", lambda: HostLimits(available=64 << 20, memlock=None))
    cfg = kvdist.load_config(make_cfg(cache={"gpu": {"blocks": 1000}, "host": {"bytes": "auto"}}))
    layout = KVLayout.from_config(cfg)
    gpu, host, disk = plan_capacity(cfg, layout, torch.device("cpu"), local_ranks=ranks)
    assert layout.bytes_per_block == 512
    # min(64 MiB x 0.5 / ranks, 1000 blocks x 512 B x 4) in blocks
    assert (gpu, host, disk) == (1000, min((32 << 20) // ranks, 2048000) // 512, 0)


@pytest.mark.gpu
def test_cuda_registration_pins_in_chunks_and_copies_asynchronously():
    layout = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, dtype="float16", tokens_per_block=16)
    dev = torch.device("cuda")
    p = HostPool(layout, 256, pin=True, device=dev, chunk_bytes=16 << 20, progress=False)
    try:
        assert p.pinned and p.raw.is_pinned() and len(p.memory.registered) == 4 and p.chunk_blocks == 64
        want = torch.arange(p.raw.numel(), dtype=torch.int64).view_as(p.raw).to(torch.uint8)
        p.raw.copy_(want)
        g = torch.empty(p.raw.shape, dtype=torch.uint8, device=dev)
        # A DMA copy must stay inside one registration (the driver refuses one that
        # spans two): one copy per chunk, both ways.
        for k in range(0, 256, p.chunk_blocks):
            g[k:k + p.chunk_blocks].copy_(p.raw[k:k + p.chunk_blocks], non_blocking=True)
        torch.cuda.synchronize()
        p.raw.zero_()
        for k in range(0, 256, p.chunk_blocks):
            p.raw[k:k + p.chunk_blocks].copy_(g[k:k + p.chunk_blocks], non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(p.raw, want)
    finally:
        p.close()
    assert p.memory.registered == []
