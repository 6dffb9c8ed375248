"""A rank whose own part of a run's set-up fails — after the cache and the model are
built, its peers on their way to the first step (``KVDIST_FAULTS=run_setup@r``) —
ends the job at once: it tells every peer (``stall.fail_alone``), each raises
PeerFailed in the collective it waits in, every rank closes its cache and leaves
alike. One line from rank 0 names the rank and its error, exit status 1, no
traceback, nothing left in /dev/shm or the disk tier (and the same line from a job
without MPI). The peers used to wait out the
first step's deadline (``distributed.consensus_timeout_s``, here far longer than the
test waits) and then name the failing rank as stalled, its error unsaid when it was
not rank 0. Real jobs through launch/kvdist-launch."""

import os
import time

import pytest

from .launching import finish, start, tiny_config

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")

WAIT_S = 600  # the peers' first-step deadline: a job that waited for the failing rank outlives the test


def _kvdist_files() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("kvdist-")}


@pytest.mark.parametrize(("np", "victim", "distributed"), [
    (None, 0, {}),  # a job without MPI: the same line
    (2, 0, {}),
    (4, 2, {}),
    (4, 3, {"tp_size": 2}),  # 2 replicas x TP 2: the other replica learns it by message (rule R3)
], ids=["alone", "main-job-rank-0", "main-job-rank-2", "replicas-rank-3"])
def test_a_rank_whose_set_up_fails_ends_the_job_at_once(tmp_path, np, victim, distributed):
    before = _kvdist_files()
    disk = tmp_path / "disk"
    cfg = tiny_config(tmp_path, disk_dir=disk,
                      distributed={"consensus_timeout_s": WAIT_S, **distributed},
                      workload={"requests": 200})
    started = time.monotonic()
    proc = start(["run", "--config", str(cfg), "--quiet", "--out", str(tmp_path / "runs")], np=np,
                 env={"KVDIST_FAULTS": f"run_setup@{victim}"})
    code, out, err = finish(proc, timeout=120)
    print(f"the job ended {time.monotonic() - started:.1f} s after its start")
    said = [ln for ln in err.splitlines() if ln.startswith("kvdist: ")]
    assert said == [f"kvdist: rank {victim} failed in the run's set-up: fault drill KVDIST_FAULTS: run_setup "
                    f"failed on rank {victim}; every rank closed its cache, the job ends"], (out, err)
    assert code == 1, (out, err)
    assert "Traceback" not in err and "BAD TERMINATION" not in out, (out, err)
    assert not (runs := tmp_path / "runs").exists() or not any(runs.rglob("results.json"))
    assert os.listdir(disk) == []
    assert _kvdist_files() - before == set()
