"""vLLM's real ``Scheduler`` seeing remote hits (``tests/vllm/replica_ranks.py``): two
replicas under ``mpiexec``, each its own scheduler beside its worker as vLLM's
``external_launcher`` runs them, kvdist's remote tier on. Replica 1 is offered the 3
blocks replica 0 saved, asynchronously (the request waits for ``finished_recving``),
loaded into the block ids its vLLM allocated, and its forward reads replica 0's bytes.
Both transports: a copy out of the peer's shared host tier, and MPI messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason=os.environ.get("KVDIST_VLLM_SKIP", "needs vLLM (make vllm)"))
if not os.environ.get("CI"):
    pytest.importorskip("mpi4py", reason="needs mpi4py in .venv-vllm (make vllm installs it)")

ROOT = Path(__file__).resolve().parents[2]


def run_ranks(tmp_path: Path, transport: str) -> list[dict]:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env = {**os.environ, "MPIEXEC_TIMEOUT": "300"}
    cmd = [str(mpiexec), "-n", "2", sys.executable, "-m", "tests.vllm.replica_ranks", str(tmp_path),
           transport]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, encoding="utf-8",
                          timeout=360)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text(encoding="utf-8")) for r in range(2)]


@pytest.mark.parametrize("transport", ["auto", "messages"])
def test_a_replica_loads_the_prefix_another_replica_saved(tmp_path, transport):
    a, b = run_ranks(tmp_path, transport)
    assert "error" not in a and "error" not in b, (a.get("error"), b.get("error"))
    assert a["remote_tier"] and b["remote_tier"] and b["listed"] == 3
    # b waits (asynchronous load) with 3 blocks from replica 0 into its own first 3 blocks
    assert b["s1_scheduled"] == {} and b["s1_async"] == ["b"] and b["planner_stats"] == 3 * 16
    assert b["fetches"] == [[[0, 0, 0], b["b_blocks"][:3]]]
    # the fetch is decided at a step's boundary (get_finished: the first one for a copy out
    # of shared memory, a later one when the messages come later): b is scheduled the
    # step after, its 4 tokens after the 48 loaded, in the blocks the load filled and one more
    assert (b["s1_recving"] or b.get("recving")) == ["b"] and b["load_errors"] == []
    assert b["b_read"] == {"b": 4} and b["b_blocks_then"][0][:3] == b["b_blocks"]
    assert len(b["b_blocks_then"][0]) == 4
    assert b["b_bytes_ok"] == [True, True]
