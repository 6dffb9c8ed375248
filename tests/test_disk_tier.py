"""The disk tier: batched threaded I/O, O_DIRECT and its fallback, a full or
unwritable path, and the file's removal on close and on a failed start."""

from __future__ import annotations

import errno
import os
import stat
import subprocess

import numpy as np
import pytest
import torch

from kvdist.errors import KVDistError
from kvdist.layout import KVLayout
from kvdist.paths import free_bytes
from kvdist.storage import disk as disk_mod
from kvdist.storage.disk import DiskPool
from kvdist.storage.host import HostMemory
from kvdist.storage.host_sizing import HostLimits

SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", tokens_per_block=4)  # 512 B
PAGE = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", tokens_per_block=16)  # 8 KiB


def blocks(n: int, nbytes: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=g)


def files(d) -> list[str]:
    return sorted(os.listdir(d))


@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize("layout", [SMALL, PAGE], ids=["512B", "8KiB"])
def test_batched_roundtrip_in_any_order(tmp_path, layout, o_direct):
    d = DiskPool(layout, 300, str(tmp_path), rank=3, io_threads=4, o_direct=o_direct)
    try:
        bpb = layout.bytes_per_block
        if o_direct and d.direct_refused:
            pytest.skip(d.direct_refused)
        assert d.direct == o_direct and files(tmp_path) == []  # the file has no name
        assert d.stride == (4096 if o_direct and bpb < 4096 else bpb)
        src = blocks(200, bpb)
        slots = np.random.default_rng(1).permutation(300)[:200].tolist()
        d.write_blocks(slots, [src[i] for i in range(200)])
        # Read back in another order, into unaligned (torch CPU) rows.
        order = np.random.default_rng(2).permutation(200).tolist()
        out = torch.zeros(200, bpb, dtype=torch.uint8)
        d.read_blocks([slots[i] for i in order], [out[k] for k in range(200)])
        assert torch.equal(out, src[order])
        # Neighbouring slots are merged into vectored calls and still land right.
        d.write_blocks(list(range(10, 40)), [src[i] for i in range(30)])
        one = torch.empty(bpb, dtype=torch.uint8)
        for k in (10, 25, 39):
            d.read(k, one.numpy())
            assert torch.equal(one, src[k - 10])
        assert d.bytes_written == 230 * bpb and d.bytes_read == 203 * bpb
        d.check_invariants()
    finally:
        d.close()
    d.check_invariants()
    assert files(tmp_path) == []


def test_direct_io_from_page_aligned_host_rows(tmp_path):
    mem = HostMemory(64 * 8192, limits=HostLimits(1 << 40, None), progress=False)
    d = DiskPool(PAGE, 64, str(tmp_path), rank=0, o_direct=True)
    try:
        if d.direct_refused:
            pytest.skip(d.direct_refused)
        rows = mem.flat.view(64, 8192)
        rows.copy_(blocks(64, 8192, seed=5))
        assert d._aligned([r.numpy() for r in rows[:2]])
        d.write_blocks(list(range(63, -1, -1)), list(rows))
        back = torch.zeros(64, 8192, dtype=torch.uint8)
        d.read_blocks(list(range(64)), list(back))
        assert torch.equal(back, rows.flip(0))
    finally:
        d.close()
        del rows
        mem.close()


def test_a_batch_writing_a_slot_twice_keeps_the_last(tmp_path):
    d = DiskPool(SMALL, 8, str(tmp_path), rank=0)
    try:
        src = blocks(3, 512)
        d.write_blocks([5, 2, 5], [src[0], src[1], src[2]])
        out = torch.empty(2, 512, dtype=torch.uint8)
        d.read_blocks([5, 2], [out[0], out[1]])
        assert torch.equal(out[0], src[2]) and torch.equal(out[1], src[1])
    finally:
        d.close()


def test_futures_and_nested_batches_on_one_thread(tmp_path):
    # One worker: a batch started from inside that worker must run inline; queueing it
    # behind the worker itself would never finish.
    d = DiskPool(SMALL, 16, str(tmp_path), rank=0, io_threads=1)
    try:
        src = blocks(16, 512, seed=3)
        d.start_writes(list(range(16)), list(src)).result(timeout=10)
        out = torch.zeros(16, 512, dtype=torch.uint8)
        f = d.submit(d.read_blocks, list(range(16)), list(out))
        f.result(timeout=10)
        assert torch.equal(out, src)
        assert d.submit(lambda: 42).result(timeout=10) == 42
    finally:
        d.close()


def test_short_transfers_are_completed(tmp_path, monkeypatch):
    real_w, real_r = os.pwritev, os.preadv

    def half_w(fd, bufs, off):  # the kernel may move fewer bytes than asked
        return real_w(fd, [memoryview(bufs[0])[:max(1, len(bufs[0]) // 2)]], off)

    def half_r(fd, bufs, off):
        return real_r(fd, [memoryview(bufs[0])[:max(1, len(bufs[0]) // 3)]], off)

    d = DiskPool(SMALL, 8, str(tmp_path), rank=0, io_threads=2)
    try:
        src = blocks(8, 512, seed=9)
        monkeypatch.setattr(disk_mod.os, "pwritev", half_w)
        d.write_blocks(list(range(8)), list(src))
        monkeypatch.setattr(disk_mod.os, "preadv", half_r)
        out = torch.zeros(8, 512, dtype=torch.uint8)
        d.read_blocks(list(range(8)), list(out))
        assert torch.equal(out, src)
    finally:
        monkeypatch.undo()
        d.close()


def test_o_direct_refused_falls_back_to_buffered_with_a_warning(tmp_path, monkeypatch, caplog):
    real = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *a)
    monkeypatch.setattr(disk_mod.os, "open", no_direct)
    d = DiskPool(SMALL, 8, str(tmp_path), rank=0, o_direct=True)
    try:
        assert not d.direct and "refuses O_DIRECT (Invalid argument)" in d.direct_refused
        assert "using buffered I/O" in caplog.text
        src = blocks(2, 512)
        d.write_blocks([1, 6], list(src))
        out = torch.zeros(2, 512, dtype=torch.uint8)
        d.read_blocks([1, 6], list(out))
        assert torch.equal(out, src)
    finally:
        d.close()
    assert files(tmp_path) == []


def test_path_too_full_names_path_bytes_asked_and_free(tmp_path):
    free = free_bytes(str(tmp_path))
    n = free // 512 + 1000
    with pytest.raises(KVDistError) as info:
        DiskPool(SMALL, n, str(tmp_path), rank=0)
    msg = str(info.value)
    assert str(tmp_path) in msg and f"{n * 512} bytes asked" in msg and "bytes free" in msg
    assert files(tmp_path) == []


def test_fallocate_enospc_is_a_clear_error_and_removes_the_file(tmp_path, monkeypatch):
    def full(fd, off, n):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(disk_mod.os, "posix_fallocate", full)
    with pytest.raises(KVDistError) as info:
        DiskPool(SMALL, 100, str(tmp_path), rank=0)
    msg = str(info.value)
    assert f"{tmp_path} is full" in msg and "51200 bytes asked" in msg and "bytes free" in msg
    assert files(tmp_path) == []


def _read_only_dir(path) -> bool:
    """Make ``path`` unwritable even for root where possible (chattr +i)."""
    if os.geteuid() != 0:
        os.chmod(path, 0o500)
        return True
    return subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0


def test_unwritable_path_is_a_clear_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    if not _read_only_dir(ro):
        pytest.skip("cannot make a directory unwritable for root here (no chattr)")
    try:
        with pytest.raises(KVDistError) as info:
            DiskPool(SMALL, 10, str(ro), rank=0)
        msg = str(info.value)
        assert f"{ro} is not writable" in msg and "5120 bytes asked" in msg and "bytes free" in msg
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(ro)], check=True)
        else:
            os.chmod(ro, 0o700)
    assert files(ro) == []


def test_the_file_has_no_name_and_close_is_idempotent(tmp_path):
    """A crash of any kind leaves nothing: the file is never linked into the
    directory, so its space goes back when the process's descriptors close."""
    d = DiskPool(SMALL, 4, str(tmp_path / "made"), rank=1)
    st = os.fstat(d.fd)
    assert st.st_nlink == 0 and st.st_size == 4 * 512 and files(tmp_path / "made") == []
    d.close()
    d.close()
    assert d.fd is None and files(tmp_path / "made") == []


def test_auto_path_is_a_private_per_user_directory(tmp_path, monkeypatch):
    """``cache.disk.path: auto`` is $TMPDIR/kvdist-<uid>, made mode 0700 when the tier
    starts (not when the config loads)."""
    from kvdist import paths

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    private = tmp_path / f"kvdist-{os.getuid()}"
    assert paths.default_disk_dir() == str(private)
    d = DiskPool(SMALL, 4, "auto", rank=0)
    try:
        st = os.lstat(private)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
        assert files(private) == []
    finally:
        d.close()


def test_auto_path_refuses_a_planted_symlink_or_another_users_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    private = tmp_path / f"kvdist-{os.getuid()}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o777)
    private.symlink_to(elsewhere)  # planted by someone else before the first run
    with pytest.raises(KVDistError, match="is a symlink"):
        DiskPool(SMALL, 4, "auto", rank=0)
    assert files(elsewhere) == []
    private.unlink()
    private.mkdir(mode=0o755)
    if os.geteuid() != 0:
        pytest.skip("making a directory another user's needs root")
    os.chown(private, 12345, 12345)
    with pytest.raises(KVDistError, match="belongs to uid 12345"):
        DiskPool(SMALL, 4, "auto", rank=0)
    assert files(private) == []
