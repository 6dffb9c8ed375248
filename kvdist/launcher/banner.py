"""What mpiexec prints when a rank dies, read as its output passes through the
launcher: the report of last resort where no watcher could read the rank's status."""

from __future__ import annotations

import re

__all__ = ["HYDRA_BANNER", "OMPI_BANNER", "Banner"]

# Whitespace normalized, NULs dropped. MPICH's Hydra, on stdout, for the first process
# of a node that a signal ended (its raw wait status as EXIT CODE; older versions give
# RANK and KILLED BY SIGNAL):
#   =   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
#   =   PID 707 RUNNING AT nodeb
#   =   EXIT CODE: 9
# Open MPI (prterun, mpirun, orterun), on stderr, wrapped anywhere:
#   prterun noticed that process rank 3 with PID 810 on node nodeb exited on
#   signal 9 (Killed).
HYDRA_BANNER = re.compile(r"BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES =+ (?:RANK (\d+) )?"
                          r"PID (\d+) RUNNING AT (\S+) =+ (?:EXIT CODE: (\d+)|KILLED BY SIGNAL: (\d+))[ (]",
                          re.ASCII)
OMPI_BANNER = re.compile(r"noticed that process rank (\d+) with PID (\d+) on node (\S+) exited on "
                         r"signal (\d+)[ .(]", re.ASCII)


class Banner:
    """The first report of a rank killed by a signal in mpiexec's output, fed as it
    passes through: (rank or None, pid, host, wait status)."""

    KEEP = 4096

    def __init__(self) -> None:
        self.tail = {1: "", 2: ""}
        self.found: tuple[int | None, int, str, int] | None = None

    def feed(self, stream: int, data: bytes) -> None:
        if self.found is not None:
            return
        text = re.sub(r"\s+", " ", self.tail[stream] + data.decode("utf-8", "replace").replace("\0", ""))
        m = HYDRA_BANNER.search(text)
        if m:
            rank, pid, host, code, sig = m.groups()
            self.found = (int(rank) if rank else None, int(pid), host, int(code if sig is None else sig))
        elif m := OMPI_BANNER.search(text):
            rank, pid, host, sig = m.groups()
            self.found = (int(rank), int(pid), host, int(sig))
        self.tail[stream] = text[-self.KEEP:]
