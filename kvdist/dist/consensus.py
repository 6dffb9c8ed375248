"""The start-up protocol (DESIGN §5): every rank builds a local candidate, then all
ranks agree to commit it, to rebuild without the host tier, or to abort."""

from __future__ import annotations

import enum
from collections.abc import Callable


class InitStatus(enum.IntEnum):
    KEEP_HOST = 0
    USE_NO_HOST = 1
    ABORT = 2


def establish(comm, build: Callable[[bool, bool], object]) -> tuple[object, InitStatus]:
    """Run the protocol; ``build(with_host, fallback)`` returns a candidate with a
    ``teardown()``. Returns the committed candidate and the agreed status."""
    if comm.size != 1:
        raise NotImplementedError("multi-rank consensus lands with the consensus issue")
    return build(True, False), InitStatus.KEEP_HOST
