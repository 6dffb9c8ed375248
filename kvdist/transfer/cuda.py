"""The executor for a GPU tier in CUDA memory: an offload and an onboard stream per
GPU, CUDA events as the per-slot pending markers. Disk transfers run on the calling
thread through one pinned bounce block."""

from __future__ import annotations

import torch

from ..storage import DiskPool, GpuPool, HostPool
from .executors import DONE


class CudaExecutor:
    """Per-block asynchronous copies on side streams (the batched path replaces the
    inner loop; ordering is the engine's and does not change)."""

    path = "per-block"

    def __init__(self, gpu: GpuPool, host: HostPool | None, disk: DiskPool | None,
                 device: torch.device):
        self.gpu, self.host, self.disk, self.device = gpu, host, disk, device
        self.streams = {"offload": torch.cuda.Stream(device), "onboard": torch.cuda.Stream(device)}
        self._bounce = (torch.empty(gpu.raw.shape[1], dtype=torch.uint8, pin_memory=True)
                        if disk is not None else None)

    def _wait_on(self, stream: torch.cuda.Stream, deps: list) -> None:
        for e in deps:
            if isinstance(e, torch.cuda.Event):
                stream.wait_event(e)

    def submit(self, stream: str, direction: str, src: list[int], dst: list[int], deps: list):
        g = self.gpu.raw
        if direction in ("offload", "onboard"):
            st = self.streams[stream]
            self._wait_on(st, deps)
            a, b = (g, self.host.raw) if direction == "offload" else (self.host.raw, g)
            with torch.cuda.stream(st):
                for s, d in zip(src, dst):
                    b[d].copy_(a[s], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(st)
            return ev
        # Disk transfers: the host waits for what they depend on, then does the I/O.
        for e in deps:
            if isinstance(e, torch.cuda.Event):
                e.synchronize()
        bounce = self._bounce
        for s, d in zip(src, dst):
            if direction == "demote":
                self.disk.write(d, self.host.raw[s].numpy())
            elif direction == "spill":
                with torch.cuda.stream(self.streams["offload"]):
                    bounce.copy_(g[s], non_blocking=True)
                self.streams["offload"].synchronize()
                self.disk.write(d, bounce.numpy())
            elif direction == "fetch":
                self.disk.read(s, bounce.numpy())
                with torch.cuda.stream(self.streams["onboard"]):
                    g[d].copy_(bounce, non_blocking=True)
                self.streams["onboard"].synchronize()
            else:
                raise AssertionError(f"unknown direction {direction}")
        return DONE

    def record_compute(self):
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def compute_wait(self, events: list) -> None:
        self._wait_on(torch.cuda.current_stream(self.device), events)

    def synchronize(self) -> None:
        for st in self.streams.values():
            st.synchronize()

    @staticmethod
    def is_done(event) -> bool:
        return event is DONE or event is None or event.query()
