"""A rank stalled before the remote tier's commit fails every rank's start-up and no
rank leaves a file in /dev/shm: tests/mpi/remote_stall_demo.py, in an MPI job of its own
(a stall ends every run-time collective of its process)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvdist.launcher.leftovers import remove_leftovers, shm_segments

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = Path(sys.executable).parent / "mpiexec"


def test_a_rank_stalled_at_the_remote_commit_leaves_no_file():
    if not MPIEXEC.exists():
        pytest.skip("no mpiexec beside this Python: `make venv` installs it")
    segments = shm_segments()
    r = subprocess.run([str(MPIEXEC), "-n", "4", sys.executable, "-m", "mpi4py", "-m", "pytest", "-q",
                        "--with-mpi", "-p", "no:cacheprovider", "tests/mpi/remote_stall_demo.py"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, encoding="utf-8",
                       env={**os.environ, "MPIEXEC_TIMEOUT": "120"})
    remove_leftovers(segments)  # what the job made, should a failure have left it
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert out.count("1 passed") == 4, out
