"""Two replicas of one TP worker each, one per MPI rank, as vLLM's ``external_launcher``
runs them (each its own scheduler beside its worker), with kvdist's remote tier on:
replica 0 saves request ``a`` to its host tier; replica 1, whose kvdist tiers and GPU
prefix cache hold nothing, is offered a's 3 blocks by its planner (found in the
directory), loads them asynchronously into the blocks its vLLM allocated, and its
forward reads a's bytes. Each rank writes what it saw to ``OUT/rank<r>.json``.

    mpiexec -n 2 python -m tests.vllm.replica_ranks OUT TRANSPORT   (auto or messages)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mpi4py import MPI

from .harness import (
    BLOCK,
    LAYERS,
    NUM_BLOCKS,
    PROMPT,
    TAIL,
    Engine,
    expected,
    model_config,
    request,
    save_a,
    vllm_config,
)

STEPS = 500


def main(out: Path, transport: str) -> None:
    world = MPI.COMM_WORLD
    rank = world.rank
    tmp = out / f"rank{rank}"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "kvdist.yaml").write_text(
        "cache:\n  device: cpu\n  host: {bytes: 64KiB}\n  recompute_when_faster: false\n"
        f"distributed:\n  tp_size: 1\n  remote: {{enabled: true, transport: {transport}, "
        "directory_every_steps: 1}\n", encoding="utf-8")
    got: dict = {"rank": rank}
    try:
        e = Engine(vllm_config(model_config(tmp / "model"), tmp / "kvdist.yaml", NUM_BLOCKS), NUM_BLOCKS,
                   tp=1, ranks=[0])
        e.tier = "host"
        cache = e.worker.kvdist
        got["remote_tier"] = cache.peers is not None and e.connector.planner.peers is cache.peers
        if rank == 0:
            got["a_blocks"] = save_a(e)
        for _ in range(STEPS):  # replica 1 hears of a's blocks (every rank steps: rank 0 serves)
            listed = len(cache.peers.directory)
            if world.allreduce(int(rank == 0 or listed >= 3), op=MPI.MIN):
                break
            e.step()
        got["listed"] = listed
        if rank == 1:
            b = e.add(request("b", PROMPT[:3 * BLOCK] + TAIL))
            s1 = e.step()
            got["s1_scheduled"] = dict(s1.out.num_scheduled_tokens)
            got["b_blocks"] = e.blocks("b")
            fetches = s1.out.kv_connector_metadata.transfers.fetches
            got["fetches"] = [[list(f.peers), list(f.blocks)] for f in fetches]
            got["s1_async"] = sorted(s1.out.kv_connector_metadata.async_loads)
            got["s1_recving"] = sorted(s1.kv.finished_recving or ())
            got["planner_stats"] = e.connector.planner.stats()["remote_hit_tokens"]
        for _ in range(STEPS):
            done = rank == 0 or "b_read" in got
            if world.allreduce(int(done), op=MPI.MIN):
                break
            s = e.step()
            if rank == 1 and s.kv.finished_recving:
                got["recving"] = sorted(s.kv.finished_recving)
            if rank == 1 and "b" in s.out.num_scheduled_tokens:
                got["b_read"] = dict(s.out.num_scheduled_tokens)
                new = s.out.scheduled_new_reqs
                got["b_blocks_then"] = [list(r.block_ids[0]) for r in new if r.req_id == "b"]
                got["b_bytes_ok"] = [s.heads("read", "b", layer)[:3].equal(
                    expected(layer, b.all_token_ids, 0, 3)) for layer in range(len(LAYERS))]
                got["load_errors"] = sorted(s.kv.invalid_block_ids or ())
        e.close()
    except Exception as exc:  # noqa: BLE001 - the test reads it
        got["error"] = f"{type(exc).__name__}: {exc}"
    (out / f"rank{rank}.json").write_text(json.dumps(got), encoding="utf-8")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
