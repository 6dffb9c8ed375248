"""kvdist-launch: start a kvdist job — one rank per GPU — under MPI (launch/kvdist-launch
is this package's ``main``). By concept:

    args.py         the command line and its checks (a mistake: one line, exit 2)
    mpiexec.py      which mpiexec and Python, the mpiexec command for MPICH or Open MPI
    job.py          running mpiexec: its output passed through, signals forwarded, its
                    death with the launcher's, the one line naming a rank that died
    server.py       where the ranks' watchers report (RankWatch), bounded and defensive
    banner.py       mpiexec's own report of a dead rank
    leftovers.py    shared-memory files a killed job leaves, removed
    wire.py         the watcher protocol and environment names (shared with the ranks)
    rank_watcher.py the watcher each rank starts (a script, standard library only)"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None, checkout=None) -> int:
    """Run kvdist-launch with ``argv`` (default: the process's); returns the exit status.
    ``checkout``: the directory whose .venv holds the default mpiexec and Python (default:
    the one this package lies in)."""
    from .job import main as run

    return run(argv, checkout)
