"""How a ``python -m kvdist run`` process behaves as one rank of a job: its rank before
MPI starts, one-line messages printed once (by rank 0), a stop on Ctrl-C or SIGTERM
that every rank makes at the same step, an exit without MPI_Abort's banners, and the
watcher (``launcher/rank_watcher.py``) that lets launch/kvdist-launch say which rank died and how."""

from __future__ import annotations

import ctypes
import faulthandler
import io
import os
import signal
import socket
import sys
import time

from .launcher.wire import ADDR_ENV as LAUNCH_ADDR_ENV
from .launcher.wire import TOKEN_ENV as LAUNCH_TOKEN_ENV

RANK_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")


def printable_anywhere() -> None:
    """Let this process print its figures and messages (which hold ×, →, µ) whatever the
    locale: a terminal or CI whose encoding is ASCII gets them escaped (\\xd7), where
    ``print`` would raise UnicodeEncodeError mid-report."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and stream.encoding.lower().replace("-", "") != "utf8":
            stream.reconfigure(errors="backslashreplace")


def launcher_rank() -> int | None:
    """This process's rank as its MPI launcher set it in the environment; None when
    no launcher started it (a job of one process)."""
    for name in RANK_VARS:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def announce_to_launcher() -> None:
    """Start this rank's watcher (``kvdist/launcher/rank_watcher.py``) when launch/kvdist-launch
    started the job (``$KVDIST_LAUNCH_ADDR``, ``$KVDIST_LAUNCH_TOKEN``): a process of
    its own session that tells the launcher which process runs this rank and, when it
    ends, how, so that the launcher names the rank that died first on whatever node
    (the survivors are killed right after, mid-sentence, and mpiexec's banner may
    name one of them). Nothing happens, and nothing fails, without the launcher."""
    addr, token, rank = os.environ.get(LAUNCH_ADDR_ENV), os.environ.get(LAUNCH_TOKEN_ENV), launcher_rank()
    if not addr or not token or rank is None or _watchers:  # one watcher a process, however many runs
        return
    import subprocess

    # Without the launcher's rank variables: the watcher is no rank to anyone looking.
    # The token stays in the environment (readable by this user only), never in argv.
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS and not k.startswith(_MPI_PREFIXES)}
    watcher = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher", "rank_watcher.py")
    try:
        _watchers.append(subprocess.Popen(
            [sys.executable, "-E", "-s", "-S", watcher, addr, str(rank), socket.gethostname(),
             str(os.getpid())], env=env, start_new_session=True, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True))
    except OSError:  # the launcher then has mpiexec's report only
        pass


_watchers: list = []  # this rank's watcher (kept: never reaped while the rank lives)
_MPI_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "HYDRA_", "HYDI_")


def world_rank() -> int:
    """This process's rank in MPI_COMM_WORLD once MPI runs, else its launcher's (0 alone)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi.COMM_WORLD.Get_rank()
    return launcher_rank() or 0


def reports() -> bool:
    """Whether this process prints the job's one-line messages (rank 0, or alone)."""
    return launcher_rank() in (None, 0)


def say(message: str) -> None:
    """``kvdist: message`` on stderr, once per job (rank 0)."""
    if reports():
        _line(f"kvdist: {message}")


def show_warnings_once() -> None:
    """kvdist's warnings (e.g. HostTierWarning) as one line without a source line, by
    rank 0 only; other warnings as Python shows them."""
    import warnings

    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if not category.__module__.startswith("kvdist"):
            default(message, category, filename, lineno, file, line)
        elif reports():
            text = str(message)
            print(text if text.startswith("kvdist") else f"kvdist: warning: {text}",
                  file=sys.stderr, flush=True)

    warnings.showwarning = show


STALLED_EXIT = 3  # a rank stalled (or the ranks called different collectives): named, the job ended
_absent: set[int] = set()  # world ranks that will never leave with the others (stalled)
FINALIZE_S = 20.0  # the most exit_now waits in MPI_Finalize
_LEAVING_TAG = 0x5A4


def say_here(message: str) -> None:
    """``kvdist: message`` on stderr, from this rank (every rank that says it)."""
    _line(f"kvdist: {message}")


def _line(text: str) -> None:
    """One write of ``text`` and its newline: ``print`` writes them apart, and unbuffered
    (PYTHONUNBUFFERED, as the Makefile and launcher set it) mpiexec can then splice another
    rank's line between the two, two ranks' lines becoming one."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def leave_without(ranks) -> None:
    """The world ``ranks`` will not leave with the others (stalled): ``exit_now`` waits
    for the rest only and does not finalize MPI (MPI_Finalize would wait for them)."""
    _absent.update(int(r) for r in ranks)


def exit_now(code: int, wait_s: float = 30.0) -> None:
    """Leave with ``code``. With MPI initialized and a non-zero code, wait (at most
    ``wait_s``) until every rank is leaving, finalize, and skip the interpreter's exit,
    where ``python -m mpi4py`` would turn the code into MPI_Abort (two lines a rank and
    a banner); mpiexec kills ranks still running when one exits with an error, so no
    rank may leave before the others are done. Every rank must be leaving alike. The
    process leaves through the C library's ``exit``, not ``os._exit``: MPICH unlinks its
    shared-memory segment in an exit handler, and without it the segment stayed in
    /dev/shm and Hydra at times killed ranks that had finalized (exit status 9 instead
    of ``code``: 5 of 8 four-rank jobs on the dev box, 2026-12-01; none through
    ``exit``). A rank finalizes even when a collective of its own never completed (a
    peer's failure or a mismatch ended it; the peers are all leaving): leaving without
    MPI_Finalize, mpiexec at times killed a rank still leaving (exit status 9: 3 of 14
    jobs whose set-up failed on one rank, dev box, 2026-12-03). Should MPI_Finalize
    still wait, the process leaves without it after ``FINALIZE_S`` (exit status 1)."""
    sys.stdout.flush()
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if code and mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        deadline = time.monotonic() + wait_s
        if _absent:
            _leave_together(mpi, deadline)
        else:
            # The process's last collective, over the launcher's world, outside the library.
            done = mpi.COMM_WORLD.Ibarrier()
            while not done.Test() and time.monotonic() < deadline:
                time.sleep(0.001)
        if _absent:
            _abort_job(mpi, code)
        faulthandler.dump_traceback_later(FINALIZE_S, exit=True, file=os.open(os.devnull, os.O_WRONLY))
        mpi.Finalize()
        try:
            ctypes.PyDLL(None).exit(code)  # C exit handlers run, holding the GIL; Python's exit does not
        finally:
            os._exit(code)
    sys.exit(code)


def _leave_together(mpi, deadline: float) -> None:
    """Wait (until ``deadline``) for a message from every world rank not absent, having
    sent one to each: every live rank is then leaving, done with its clean-up."""
    world = mpi.COMM_WORLD
    me = world.Get_rank()
    peers = [r for r in range(world.Get_size()) if r != me and r not in _absent]
    bufs = [bytearray(1) for _ in peers]
    token = bytearray(1)
    sends = [world.Isend([token, mpi.BYTE], dest=r, tag=_LEAVING_TAG) for r in peers]
    recvs = [world.Irecv([b, mpi.BYTE], source=r, tag=_LEAVING_TAG) for r, b in zip(peers, bufs)]
    while not all(r.Test() for r in recvs) and time.monotonic() < deadline:
        time.sleep(0.001)
    _held.append((sends, recvs, bufs, token))


def _abort_job(mpi, code: int) -> None:
    """End a job in which some ranks are stalled, once every live rank is leaving: only
    the launcher can end a stopped process, and MPI_Finalize would wait for it. The
    lowest live rank calls MPI_Abort (mpiexec then kills every rank, and its exit status
    is ``code``; leaving by exit() instead made it report the killed rank's 9 now and
    then); its banner is not shown (each rank has said what happened). The others wait
    to be killed, and leave by themselves should that not come."""
    world = mpi.COMM_WORLD
    me = world.Get_rank()
    if me == min(r for r in range(world.Get_size()) if r not in _absent):
        time.sleep(0.2)  # mpiexec forwards what the ranks printed before it kills any
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        world.Abort(code)
    time.sleep(5.0)
    try:
        ctypes.PyDLL(None).exit(code)
    finally:
        os._exit(code)


_held: list = []  # requests of _leave_together (never freed: the process is leaving)


# -- stopping on a signal ------------------------------------------------------------------------
class Interrupted(Exception):
    """The job stopped at a step boundary because of ``signum`` (on ``rank``)."""

    def __init__(self, signum: int, rank: int):
        self.signum = signum
        self.rank = rank
        super().__init__(self.line())

    def line(self) -> str:
        if self.signum == signal.SIGINT:
            return "interrupted; caches closed"
        return f"stopped by {signal.Signals(self.signum).name} on rank {self.rank}; caches closed"

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_stop = [0]  # the first stop signal received (0: none)


def stop_signal() -> int:
    return _stop[0]


def encode_stop(rank: int) -> int:
    """This rank's stop request as one int whose MAX over the ranks names the worst
    signal and a rank that got it (0: no rank wants to stop)."""
    return _stop[0] * 65536 + rank + 1 if _stop[0] else 0


def decode_stop(value: int) -> Interrupted | None:
    return Interrupted(value // 65536, value % 65536 - 1) if value else None


def stop_on_signals() -> None:
    """SIGINT and SIGTERM ask the job to stop at the next step boundary (the ranks
    agree on it, close their caches, and rank 0 says so). A second SIGINT to a process
    running alone stops it at once; under MPI the launcher forwards Ctrl-C too, so
    repeats are ignored there (mpiexec's own second Ctrl-C force-kills the job)."""
    alone = launcher_rank() is None

    def handler(signum, frame) -> None:
        if not _stop[0]:
            _stop[0] = signum
        elif alone and signum == signal.SIGINT:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
