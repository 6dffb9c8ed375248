"""kvdist-launch's account of a dead rank, without MPI: what it reads in
mpiexec's banners (MPICH's Hydra, Open MPI's prterun, as each printed them on the
two-node test bed) and which rank its line names, from the watchers' reports and the
banner (tests/nodes/test_two_nodes.py kills real ranks on both nodes)."""

import signal

import pytest

from kvdist.launcher.banner import Banner
from kvdist.launcher.leftovers import remove_leftovers, shm_segments
from kvdist.launcher.server import RankWatch

HYDRA = b"""
===================================================================================
=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   PID 707 RUNNING AT kvn668b
=   EXIT CODE: 9
=   CLEANING UP REMAINING PROCESSES
=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES
===================================================================================
"""
HYDRA_OLD = b"""=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   RANK 1 PID 5491 RUNNING AT gn59
=   KILLED BY SIGNAL: 11 (Segmentation fault)
"""
OMPI = b"""--------------------------------------------------------------------------
prterun noticed that process rank 3 with PID 810 on node kvn751b exited on
signal 9 (Killed).
--------------------------------------------------------------------------
\0"""
OMPI_ABORT = b"""prterun has exited due to process rank 1 with PID 0 on node kvn3551a calling
"abort". This may have caused other processes in the application to be
terminated by signals sent by prterun (as reported here).
"""


@pytest.mark.parametrize("stream,text,found", [
    (1, HYDRA, (None, 707, "kvn668b", 9)),
    (1, HYDRA_OLD, (1, 5491, "gn59", 11)),
    (2, OMPI, (3, 810, "kvn751b", 9)),
    (2, OMPI_ABORT, None),
])
def test_banners_read_in_any_chunks(stream, text, found):
    for size in (len(text), 7, 1):
        banner = Banner()
        for i in range(0, len(text), size):
            banner.feed(stream, text[i:i + size])
        assert banner.found == found, size


def watch(ranks, ended=(), status=None, output=b"", stream=1):
    w = RankWatch.__new__(RankWatch)  # no listener: the reports are given
    w.ranks, w.ended, w.status, w.banner = dict(ranks), list(ended), dict(status or {}), Banner()
    w.banner.feed(stream, output)
    return w.verdict()


RANKS = {0: ("kvn668a", 700), 1: ("kvn668a", 701), 2: ("kvn668b", 706), 3: ("kvn668b", 707)}


def test_the_first_reported_end_is_named_with_its_watchers_status():
    # Open MPI's banner named a survivor that aborted; the watchers know better
    assert watch(RANKS, ended=[3, 1, 0, 2], status={3: signal.SIGKILL, 1: 14 << 8},
                 output=OMPI_ABORT, stream=2) == "rank 3 (pid 707 on kvn668b) was killed by SIGKILL"
    # a stop every rank made (SIGTERM, Ctrl-C) ends with an exit status: no line
    assert watch(RANKS, ended=[1, 0], status={1: 143 << 8, 0: 143 << 8}) is None


def test_the_banner_gives_the_status_a_watcher_could_not_read():
    assert watch(RANKS, ended=[3], status={3: None}, output=HYDRA) == \
        "rank 3 (pid 707 on kvn668b) was killed by SIGKILL"
    # ... only when it names the same process
    assert watch(RANKS, ended=[2], status={2: None}, output=HYDRA) is None
    # no watcher at all (not `run`): the banner alone, when the rank is known
    assert watch({}, output=OMPI, stream=2) == "rank 3 (pid 810 on kvn751b) was killed by SIGKILL"
    assert watch({}, output=HYDRA) is None


def test_leftover_segments_go_unless_a_live_process_maps_them(tmp_path):
    """After a job, the launcher removes MPICH's segments that appeared during it and
    that no process maps (a killed rank's); another job's, mapped, and older ones stay."""
    shm, proc = tmp_path / "shm", tmp_path / "proc"
    (proc / "4242").mkdir(parents=True)
    shm.mkdir()
    (shm / "mpich_shm_old_0").write_bytes(b"x")  # before the job: not the launcher's to judge
    before = shm_segments(shm)
    for name in ("mpich_shm_left_0", "mpich_shm_live_0", "other_0"):
        (shm / name).write_bytes(b"x")
    live = shm / "mpich_shm_live_0"
    (proc / "4242" / "maps").write_text(f"7f00-7f10 rw-s 00000000 00:1a 99   {live}\n"
                                        "7f20-7f30 r-xp 00000000 08:01 12   /usr/lib/libc.so.6\n",
                                            encoding="utf-8")
    assert remove_leftovers(before, shm, proc, grace_s=0.1) == 1
    assert sorted(p.name for p in shm.iterdir()) == ["mpich_shm_live_0", "mpich_shm_old_0", "other_0"]
