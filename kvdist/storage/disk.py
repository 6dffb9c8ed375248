"""The disk tier: one preallocated file per rank, blocks read and written with
positional I/O. The file is private to the process that made it and removed on
``close()``."""

from __future__ import annotations

import os
import tempfile

from ..errors import KVDistError
from ..layout import KVLayout


class DiskPool:
    """``num_blocks`` blocks in a file under ``directory``."""

    def __init__(self, layout: KVLayout, num_blocks: int, directory: str, rank: int):
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_bytes = layout.bytes_per_block
        nbytes = num_blocks * self.block_bytes
        # mkstemp gives a name no other process (rank, job, COMM_SELF cache) can share.
        fd, self.path = tempfile.mkstemp(prefix=f"kvdist-r{rank}-", suffix=".blocks", dir=directory)
        self.fd = fd
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            self.close()
            raise KVDistError(
                f"cannot preallocate a disk tier of {nbytes} bytes in {directory}: {e.strerror}"
            ) from e

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def write(self, slot: int, buf) -> None:
        """Write one block (a bytes-like of ``block_bytes``) into ``slot``."""
        n = os.pwrite(self.fd, buf, slot * self.block_bytes)
        if n != self.block_bytes:
            raise KVDistError(f"short write to disk tier slot {slot}: {n} of {self.block_bytes} bytes")

    def read(self, slot: int, buf) -> None:
        """Read the block in ``slot`` into a writable bytes-like of ``block_bytes``."""
        n = os.preadv(self.fd, [buf], slot * self.block_bytes)
        if n != self.block_bytes:
            raise KVDistError(f"short read from disk tier slot {slot}: {n} of {self.block_bytes} bytes")

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.path and os.path.exists(self.path):
            os.unlink(self.path)
