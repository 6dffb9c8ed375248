"""Page-locking host memory for CUDA: ``cudaHostRegister`` / ``cudaHostUnregister``
through cuda-bindings when it is installed, else through ``torch.cuda.cudart()``.

A registrar is anything with ``register(ptr, nbytes)`` (raises
:class:`RegistrationError`) and ``unregister(ptr)``; tests inject a fake one to
count registrations and to fail on a chosen call, without CUDA."""

from __future__ import annotations

import ctypes
from typing import Protocol

import torch

from .. import cudart

# cudaHostRegisterPortable: pinned for every CUDA context, so a rank whose GPU is
# not device 0 (and any engine thread on another device) sees the memory as pinned.
HOST_REGISTER_PORTABLE = 1


def _clear_torch_last_error() -> None:
    """Reset the last-error slot of the libcudart torch loaded: torch checks it after
    every kernel launch, and a handled registration failure must not resurface there.
    torch.cuda.cudart() has no cudaGetLastError, so load the same library by path."""
    for path in cudart.loaded_paths():
        try:
            ctypes.CDLL(path).cudaGetLastError()
        except OSError:
            pass


class RegistrationError(Exception):
    """A registration call failed; the message is the driver's."""


class Registrar(Protocol):
    name: str

    def register(self, ptr: int, nbytes: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...


class CudaRegistrar:
    """Registers ranges with the CUDA driver while ``device`` is current, so no
    context is created on another GPU."""

    def __init__(self, device: torch.device):
        assert device.type == "cuda", f"CudaRegistrar needs a CUDA device, got {device}"
        self.device = device
        torch.cuda.init()
        try:
            from cuda.bindings import runtime
        except ImportError:
            runtime = None
        self._rt = runtime
        self.name = "cuda-bindings" if runtime is not None else "torch.cuda.cudart"
        self._torch_rt = None if runtime is not None else torch.cuda.cudart()

    def _call(self, what: str, *args) -> None:
        with torch.cuda.device(self.device):
            if self._rt is not None:
                res = getattr(self._rt, what)(*args)
                err = res[0] if isinstance(res, tuple) else res
                if int(err) == 0:
                    return
                # cuda-bindings keeps its own last-error slot: clear it so the failure
                # does not resurface at an unrelated call.
                self._rt.cudaGetLastError()
                text = self._rt.cudaGetErrorString(err)
                text = text[1] if isinstance(text, tuple) else text
            else:
                err = getattr(self._torch_rt, what)(*args)
                if int(err) == 0:
                    return
                text = self._torch_rt.cudaGetErrorString(err)
                _clear_torch_last_error()
        if isinstance(text, bytes):
            text = text.decode(errors="replace")
        raise RegistrationError(f"{what} failed: {text} (error {int(err)})")

    def register(self, ptr: int, nbytes: int) -> None:
        self._call("cudaHostRegister", ptr, nbytes, HOST_REGISTER_PORTABLE)

    def unregister(self, ptr: int) -> None:
        self._call("cudaHostUnregister", ptr)
