"""vLLM's ``external_launcher`` with the connector (``tests/vllm/launcher_ranks.py``): two
processes, each one engine with its own scheduler and one TP worker, joined as vLLM's own
worker joins them and with the worker-side connector built by vLLM. Under ``mpiexec``
(``launcher_env()`` sets vLLM's variables from MPI) kvdist's ranks are vLLM's TP ranks,
and what the workers report is agreed across them, so a load failing on one rank makes
both schedulers recompute it; under ``torchrun`` alone the start stops in one line.
vLLM's ``ExecutorWithExternalLauncher`` itself stops earlier on this machine (no platform,
no CPU kernels): README "Running vLLM with kvdist" says what is and is not run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason=os.environ.get("KVDIST_VLLM_SKIP", "needs vLLM (make vllm)"))
if not os.environ.get("CI"):
    pytest.importorskip("mpi4py", reason="needs mpi4py in .venv-vllm (make vllm installs it)")

ROOT = Path(__file__).resolve().parents[2]
CMD = [sys.executable, "-m", "tests.vllm.launcher_ranks"]


def _read(tmp_path: Path) -> list[dict]:
    return [json.loads((tmp_path / f"rank{r}.json").read_text(encoding="utf-8")) for r in range(2)]


def under_mpiexec(tmp_path: Path, faults: str = "") -> list[dict]:
    env = {**os.environ, "KVDIST_FAULTS": faults, "MPIEXEC_TIMEOUT": "300"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", "2", *CMD, str(tmp_path), "mpiexec"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=360,
        encoding="utf-8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _read(tmp_path)


def test_under_mpiexec_vllms_tp_ranks_are_kvdists_and_a_load_failing_on_one_makes_both_recompute(tmp_path):
    """Rank 1's loads fail (the ``external_load`` drill), rank 0's land with exact bytes:
    each rank's scheduler sees the failed blocks of both (what vLLM's aggregator gives its
    one scheduler) and both recompute b, instead of rank 0 going on alone."""
    got = under_mpiexec(tmp_path, "external_load@1")
    for rank, g in enumerate(got):
        assert "error" not in g, g["error"]
        assert g["executor"] == "ExecutorWithExternalLauncher"
        assert {k: g["env"][k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")} == \
            {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
        assert (g["rank"], g["tp_rank"], g["kvdist_rank"], g["world_size"]) == (rank, rank, rank, 2)
        assert g["tiers"] == ["host"] and g["a_sent"] == ["a"]
        assert g["b_blocks"][:3] != g["a_blocks"][:3] and g["s3_scheduled"] == {"b": 4}
        assert g["s3_invalid"] == g["b_blocks"][:3]
        assert g["s4_scheduled"] == {"b": 3 * 16 + 4}  # recomputed from the first failed block
    assert got[0]["env"]["MASTER_PORT"] == got[1]["env"]["MASTER_PORT"]
    assert got[0]["b_blocks"] == got[1]["b_blocks"]
    assert got[0]["b_bytes_ok"] == [True, True] and got[1]["b_bytes_ok"] == [False, False]  # by layer


def test_under_torchrun_alone_each_workers_kvdist_is_alone_and_the_start_stops_in_one_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "MPI", "OMPI", "HYDI"))}
    env |= {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "KVDIST_FAULTS": ""}
    procs = [subprocess.Popen([*CMD, str(tmp_path), "torchrun"], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              encoding="utf-8") for r in range(2)]
    for p in procs:
        p.communicate(timeout=300)
    for g in _read(tmp_path):
        assert g["error"].startswith("ConfigError: ") and "\n" not in g["error"]
        assert "parallel_config.tensor_parallel_size" in g["error"] and "mpiexec" in g["error"]


def test_a_request_the_ranks_name_in_different_steps_is_agreed_when_the_last_names_it():
    """A save finished on rank 0 a step before rank 1: every rank's scheduler hears of it
    once, in the step rank 1 names it; failed blocks are the union, figures the MIN."""
    from kvdist.integrations.vllm.agree import Agreement, Report

    def report(saved=(), loaded=(), failed=(), figures=(5, 9, 7)) -> Report:
        return Report(frozenset(saved), frozenset(loaded), frozenset(failed), figures)

    agree = Agreement(2)
    assert agree.step([report({"a"}, failed={3}), report(failed={4}, figures=(6, 8, 7))]) == \
        report(failed={3, 4}, figures=(5, 8, 7))
    assert agree.pending() == {"a"}
    assert agree.step([report(loaded={"b"}), report({"a"}, {"b"})]) == report({"a"}, {"b"})
    assert agree.pending() == set()
