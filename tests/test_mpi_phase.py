"""The MPI phase's own rules: a failure on one rank ends the MPI job within seconds
(not at MPIEXEC_TIMEOUT), and a plain run does not collect the MPI tests."""

import os
import subprocess
import sys
import time
from pathlib import Path

from kvdist.launcher.leftovers import remove_leftovers, shm_segments

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = Path(sys.executable).parent / "mpiexec"


def test_a_failure_on_one_rank_aborts_the_mpi_job_at_once():
    segments = shm_segments()
    t0 = time.monotonic()
    r = subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, "-m", "mpi4py", "-m", "pytest", "-q",
                        "--with-mpi", "-p", "no:cacheprovider", "tests/mpi/failing_demo.py"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "MPIEXEC_TIMEOUT": "300"}, encoding="utf-8")
    seconds = time.monotonic() - t0
    remove_leftovers(segments)  # the aborted ranks leave MPICH's segment: what this test made
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    # Hydra forwards the ranks' output through pipes and may drop what a rank wrote just
    # before MPI_Abort killed the job (seen in CI: nothing at all came back; on the dev
    # box, 2026-12-01, only pytest's "F"). The rule itself is the status and the time;
    # what arrives must be the demo's failure, not another error.
    assert "rank 1 fails on purpose" in out or ("Error" not in out and "Traceback" not in out), out
    assert seconds < 120, f"the job ran {seconds:.0f} s: it waited for MPIEXEC_TIMEOUT"


def test_a_plain_run_does_not_collect_the_mpi_tests():
    from types import SimpleNamespace

    from . import conftest

    def config(with_mpi):
        return SimpleNamespace(getoption=lambda name, default=None: with_mpi if name == "with_mpi"
                               else default)

    mpi = ROOT / "tests" / "mpi"
    assert conftest.MPI_TESTS == mpi and (mpi / "test_consensus.py").exists()
    assert conftest.pytest_ignore_collect(mpi, config(False)) is True
    assert conftest.pytest_ignore_collect(mpi, config(True)) is None  # make mpi: --with-mpi
    assert conftest.pytest_ignore_collect(ROOT / "tests" / "nodes", config(False)) is None
