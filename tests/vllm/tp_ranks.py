"""One vLLM TP worker per MPI rank, as vLLM's ``external_launcher`` runs them under
``mpiexec``: each rank has its own scheduler and one worker-side connector holding its
share of the KV heads, and kvdist's start-up consensus runs over a Dup of COMM_WORLD
(``tests/vllm/test_tp_processes.py`` starts it). Request ``a`` is saved to kvdist and
``b`` (its 3 blocks, another tail) loads them; each rank writes what it saw to
``OUT/rank<r>.json``.

    mpiexec -n 2 python -m tests.vllm.tp_ranks OUT TIERS   (TIERS: host+disk or host)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mpi4py import MPI

from .harness import (
    BLOCK,
    HEADS,
    LAYERS,
    NUM_BLOCKS,
    PROMPT,
    TAIL,
    Engine,
    expected,
    model_config,
    request,
    vllm_config,
)


def routes(t) -> list[tuple[str, int, int]]:
    return [(r.name, s, d) for r, s, d in zip(t.routes(), t.src.tolist(), t.dst.tolist())]


def main(out: Path, tiers: str) -> None:
    world = MPI.COMM_WORLD
    rank, tp = world.rank, world.size
    tmp = out / f"rank{rank}"
    lines = ["cache:", "  device: cpu", "  host: {bytes: 64KiB}", "  recompute_when_faster: false"]
    if "disk" in tiers:
        lines.append(f"  disk: {{path: {out / 'disk'}, bytes: 64KiB}}")  # one directory, a file per rank
    (tmp).mkdir(parents=True, exist_ok=True)
    (tmp / "kvdist.yaml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    got: dict = {"rank": rank}
    try:
        model = model_config(tmp / "model")
        e = Engine(vllm_config(model, tmp / "kvdist.yaml", NUM_BLOCKS), NUM_BLOCKS, tp=tp, ranks=[rank])
        cache = e.worker.kvdist
        plan = e.connector.planner.tiers
        got |= {"init_status": cache.init_status.name, "tiers": list(cache.tiers),
                "world_size": cache.world_size, "planner_tiers": [plan.host_blocks, plan.disk_blocks]}
        e.add(request("a", PROMPT))
        s1 = e.step()
        a_blocks = list(s1.out.scheduled_new_reqs[0].block_ids[0])
        got["a_saves"] = routes(s1.out.kv_connector_metadata.saves)
        got["a_blocks"] = a_blocks
        got["a_sent"] = sorted(e.step().kv.finished_sending or ())
        assert e.scheduler.reset_prefix_cache()
        b = e.add(request("b", PROMPT[:3 * BLOCK] + TAIL))
        s3 = e.step()
        got["b_scheduled"] = dict(s3.out.num_scheduled_tokens)
        got["b_loads"] = routes(s3.out.kv_connector_metadata.transfers)
        got["b_blocks"] = list(s3.out.scheduled_new_reqs[0].block_ids[0])
        heads = slice(rank * HEADS // tp, (rank + 1) * HEADS // tp)
        got["b_bytes_ok"] = [
            s3.heads("read", "b", layer)[:3].equal(expected(layer, b.all_token_ids, 0, 3)[:, :, heads])
            for layer in range(len(LAYERS))]
        e.close()
    except Exception as exc:  # noqa: BLE001 - the test reads it
        got["error"] = f"{type(exc).__name__}: {exc}"
    (out / f"rank{rank}.json").write_text(json.dumps(got), encoding="utf-8")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
