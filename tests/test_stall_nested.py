"""A stopped rank is named alone while its peers wait in collectives of different
communicators (its TP group's, the job's): tests/mpi/nested_stall_demo.py, one MPI job a
case (a stall ends every run-time collective of its process)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvdist.launcher.leftovers import remove_leftovers, shm_segments

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = Path(sys.executable).parent / "mpiexec"


@pytest.mark.parametrize("case", ["group-first", "job-first", "late-in-grace"])
def test_the_stopped_rank_alone_is_named(case):
    if not MPIEXEC.exists():
        pytest.skip("no mpiexec beside this Python: `make venv` installs it")
    segments = shm_segments()
    r = subprocess.run([str(MPIEXEC), "-n", "4", sys.executable, "-m", "mpi4py", "-m", "pytest", "-q",
                        "--with-mpi", "-p", "no:cacheprovider", "tests/mpi/nested_stall_demo.py"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, encoding="utf-8",
                       env={**os.environ, "MPIEXEC_TIMEOUT": "120", "KVDIST_NESTED_CASE": case})
    remove_leftovers(segments)  # an aborted job leaves MPICH's segment: what this test made
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert out.count("1 passed") == 4, out
