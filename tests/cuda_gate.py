"""A deterministic gate for CUDA race tests: a one-thread kernel on a stream spins on a
flag in pinned (GPU-mapped) host memory until the host sets it. Work queued behind the
gate waits; work that does not depend on it runs at once. No sleeps, no timing.

The spin gives up after ``timeout_s`` and records it (``expired``), so a broken test
(a host wait behind a closed gate) fails instead of hanging; a test can also use that
to show a dependency that should not exist. A kernel used for the first time behind a
closed gate is such a host wait under lazy module loading (CUDA waits for the running
spin): run tests with ``CUDA_MODULE_LOADING=EAGER`` or run kernels once before closing.

Built with NVRTC and launched through the driver API (``cuda.bindings``), compiled once
per process."""

from __future__ import annotations

import numpy as np
import torch

SPIN = r"""
extern "C" __global__ void kvdist_spin_until_set(const volatile int* flag, volatile int* expired,
                                                 long long max_cycles) {
    long long start = clock64();
    while (*flag == 0) {
        if (clock64() - start > max_cycles) { *expired = 1; return; }
    }
}
"""


def _compile(device: torch.device):
    from cuda.bindings import driver, nvrtc

    major, minor = torch.cuda.get_device_capability(device)
    err, prog = nvrtc.nvrtcCreateProgram(SPIN.encode(), b"spin.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    opts = [f"--gpu-architecture=sm_{major}{minor}".encode()]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"nvrtc: {log.decode(errors='replace')}")
    _, size = nvrtc.nvrtcGetCUBINSize(prog)
    cubin = b" " * size
    (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    nvrtc.nvrtcDestroyProgram(prog)
    torch.zeros(1, device=device)  # makes the primary context current
    image = np.frombuffer(cubin, dtype=np.uint8)
    err, module = driver.cuModuleLoadData(image.ctypes.data)
    assert err == driver.CUresult.CUDA_SUCCESS, err
    err, fn = driver.cuModuleGetFunction(module, b"kvdist_spin_until_set")
    assert err == driver.CUresult.CUDA_SUCCESS, err
    return driver, module, fn


class SpinGate:
    """Holds a stream from ``close(stream)`` until ``open()``."""

    _compiled = None  # (driver, module, function), once per process

    def __init__(self, timeout_s: float = 2.0):
        if SpinGate._compiled is None:
            SpinGate._compiled = _compile(torch.device("cuda"))
        self.max_cycles = int(timeout_s * 2.0e9)  # SM clock <= ~2 GHz: at least timeout_s
        self.flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # mapped: UVA pointers
        self._expired = torch.zeros(1, dtype=torch.int32, pin_memory=True)

    def close(self, stream: torch.cuda.Stream) -> SpinGate:
        """Everything queued on ``stream`` from now on waits for ``open``. The previous
        spin of this gate must be over (``check`` or a synchronize)."""
        driver, _, fn = SpinGate._compiled
        self.flag[0] = 0
        self._expired[0] = 0
        args = [np.array([self.flag.data_ptr()], dtype=np.uint64),
                np.array([self._expired.data_ptr()], dtype=np.uint64),
                np.array([self.max_cycles], dtype=np.int64)]
        params = np.array([a.ctypes.data for a in args], dtype=np.uint64)
        (err,) = driver.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, driver.CUstream(stream.cuda_stream),
                                       params.ctypes.data, 0)
        assert err == driver.CUresult.CUDA_SUCCESS, err
        return self

    def open(self) -> None:
        self.flag[0] = 1

    @property
    def expired(self) -> bool:
        """Whether the spin gave up before ``open`` (read after the spin is over)."""
        return bool(self._expired[0])

    def check(self) -> None:
        """Wait for the device; fail if the gate expired instead of being opened."""
        torch.cuda.synchronize()
        assert not self.expired, "the gate timed out: the stream was never released in time"
