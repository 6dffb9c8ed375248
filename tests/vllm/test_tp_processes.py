"""TP workers in separate processes: ``mpiexec -n 2`` runs one vLLM worker per MPI rank
(``tests/vllm/tp_ranks.py``, as vLLM's ``external_launcher`` runs them), each with its
own scheduler and a worker-side connector over its KV head, and kvdist's start-up
consensus over a Dup of COMM_WORLD. A rank that cannot pin its host tier makes every
rank drop it (USE_NO_HOST), and each scheduler's planner adopts the tiers its workers
committed (vLLM's handshake metadata), so saves and loads go to disk with exact bytes;
with no disk tier left the start stops with one line."""

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


def run_ranks(tmp_path: Path, tiers: str, faults: str) -> list[dict]:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env = {**os.environ, "KVDIST_FAULTS": faults, "MPIEXEC_TIMEOUT": "300"}
    cmd = [str(mpiexec), "-n", "2", sys.executable, "-m", "tests.vllm.tp_ranks", str(tmp_path), tiers]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=360,
        encoding="utf-8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text(encoding="utf-8")) for r in range(2)]


def test_a_rank_without_its_host_tier_makes_every_rank_and_the_planner_drop_it(tmp_path):
    got = run_ranks(tmp_path, "host+disk", "host_tier@1")
    for rank, g in enumerate(got):
        assert "error" not in g, g["error"]
        assert (g["rank"], g["world_size"], g["init_status"]) == (rank, 2, "USE_NO_HOST")
        assert g["tiers"] == ["disk"]
        assert g["planner_tiers"] == [0, 32]  # 64 KiB of 2 KiB blocks (one head of two)
        a = g["a_blocks"]
        assert g["a_saves"] == [["spill", a[0], 0], ["spill", a[1], 1], ["spill", a[2], 2]]
        assert g["a_sent"] == ["a"]
        b = g["b_blocks"]
        assert g["b_scheduled"] == {"b": 4}
        assert g["b_loads"] == [["reload", 0, b[0]], ["reload", 1, b[1]], ["reload", 2, b[2]]]
        assert g["b_bytes_ok"] == [True, True]  # this rank's head, layer by layer


def test_no_tier_left_after_the_fallback_stops_the_start_with_one_line(tmp_path):
    got = run_ranks(tmp_path, "host", "host_tier@1")
    for g in got:
        assert g["error"].startswith("HostTierUnavailable: the host tier could not be had on some worker")
        assert "no disk tier is configured (cache.disk)" in g["error"] and "\n" not in g["error"]
