"""kvdist-launch's command line: its options, their checks, and the help text. A
mistake is one line on stderr and exit status 2 (``LaunchArgs.parse`` raises
SystemExit(2))."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

__all__ = ["DEFAULT_TIMEOUT_S", "HELP", "LaunchArgs", "fail", "parse"]

DEFAULT_TIMEOUT_S = 3600
HELP = """start a kvdist job — one rank per GPU — under MPI.

    launch/kvdist-launch [-n NP] [--hostfile FILE] [--ppn N] [--timeout S] [--dry-run]
                         [--module M] [--] COMMAND ARGS...      # a `python -m kvdist` command

    launch/kvdist-launch -n 4 run --config configs/default.yaml
    launch/kvdist-launch -n 8 --hostfile hosts --ppn 4 run --config configs/multinode.yaml
    launch/kvdist-launch -n 8 --hostfile hosts --ppn 4 placement     # who runs where

It finds ``mpiexec`` ($MPIEXEC, else the repository's .venv (MPICH from pip), else the
one next to the Python it runs, else PATH), adds what Open MPI needs
(``--oversubscribe``, ``--allow-run-as-root`` when root, ``-x`` for kvdist's
environment) and runs every rank as ``python -m mpi4py -m kvdist ...`` (``--module M``:
``-m M``, e.g. an engine embedding kvdist): a rank that dies with an exception aborts
the whole job instead of leaving the others hanging in a collective. The ranks' mpi4py
loads the MPI library of that mpiexec (``MPI4PY_LIBMPI``). ``MPIEXEC_TIMEOUT`` (seconds;
0 = none) bounds the whole job.

The job ends with the launcher: SIGINT, SIGTERM or SIGHUP is forwarded to mpiexec (the
ranks stop at their next step; a second one, or 1.5 s without an end, has each watcher
stop its rank), and
if the launcher itself is killed, mpiexec gets SIGTERM from the kernel and each rank's
watcher stops its rank. When a rank dies, one line names it, on whichever node:
``kvdist: rank 3 (pid 4711 on node7) was killed by SIGKILL; the job ends``. Shared
memory a killed job leaves in /dev/shm (MPICH's segments, the remote tier's files) is
removed on every node."""


@dataclass(frozen=True, slots=True)
class LaunchArgs:
    np: int
    hostfile: str | None
    ppn: int | None
    timeout: int | None
    mpiexec: str | None
    python: str | None
    module: str
    dry_run: bool
    command: list[str]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not the usage block
        print(f"kvdist-launch: {message}", file=sys.stderr)
        raise SystemExit(2)


def _parser() -> _Parser:
    p = _Parser(prog="kvdist-launch", description=HELP.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="\n\n".join(HELP.split("\n\n")[1:]))
    p.add_argument("-n", "--np", type=int, default=4, help="number of ranks (default 4)")
    p.add_argument("--hostfile", help="hosts to run on (multi-node); passed to mpiexec")
    p.add_argument("--ppn", type=int, default=None, help="ranks per node (one per GPU)")
    p.add_argument("--timeout", type=int, default=None,
                   help=f"MPIEXEC_TIMEOUT in seconds (default: the environment's, else {DEFAULT_TIMEOUT_S}; "
                        "0 = none)")
    p.add_argument("--mpiexec", help="the mpiexec to use (default: see below)")
    p.add_argument("--python", help="the Python of the ranks (default: the repo's .venv)")
    p.add_argument("--module", default="kvdist", help="the Python module every rank runs (default kvdist)")
    p.add_argument("--dry-run", action="store_true", help="print the command and exit")
    p.add_argument("command", nargs=argparse.REMAINDER, help="a `python -m kvdist` command (or --module's)")
    return p


def parse(argv: list[str]) -> LaunchArgs:
    """The launcher's arguments; a mistake prints one line and exits with status 2."""
    p = _parser()
    a = p.parse_args(argv)
    command = a.command[1:] if a.command and a.command[0] == "--" else a.command
    if not command and a.module == "kvdist":
        p.error("give a kvdist command, e.g. `run --config configs/default.yaml`")
    if a.np < 1:
        p.error(f"-n must be at least 1 (got {a.np})")
    if a.ppn is not None and a.ppn < 1:
        p.error(f"--ppn must be at least 1 (got {a.ppn})")
    if a.timeout is not None and a.timeout < 0:
        p.error(f"--timeout must be 0 (none) or more seconds (got {a.timeout})")
    if a.hostfile and not os.path.isfile(a.hostfile):
        p.error(f"--hostfile {a.hostfile!r}: no such file")
    if not a.module.replace(".", "").replace("_", "").isalnum():
        p.error(f"--module {a.module!r}: not a Python module name")
    return LaunchArgs(a.np, a.hostfile, a.ppn, a.timeout, a.mpiexec, a.python, a.module, a.dry_run, command)


def fail(message: str) -> SystemExit:
    """A mistake found after parsing (an option that names nothing usable): one line."""
    print(f"kvdist-launch: {message}", file=sys.stderr)
    return SystemExit(2)
