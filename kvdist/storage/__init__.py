"""Raw slots of memory per tier. A pool knows how many blocks of how many bytes it
holds and how to read/write one; nothing about requests, hashes or ordering."""

from .disk import DiskPool
from .gpu import GpuPool
from .host import HostPool

__all__ = ["DiskPool", "GpuPool", "HostPool"]
