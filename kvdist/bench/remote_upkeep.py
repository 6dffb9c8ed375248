"""``python -m kvdist bench remote --upkeep`` (under ``mpiexec -n 8``): what keeping the
directory and agreeing inside the TP groups adds to a rank's per-step cache
bookkeeping, with R = world / ``--tp`` replicas.

The same request stream is run twice in one job, replicas isolated (remote tier off)
and sharing: every replica serves its own requests over shared system prompts (so
its peers' blocks are worth fetching), through the real cache API, without a model.
Per step and rank it prints the manager's bookkeeping (sequences, reuse, eviction),
the remote tier's upkeep (stamps, directory records sent and applied, polling), the
TP group's agreement (one MIN-reduce a step: its time includes waiting for the
slowest rank of the group) and the waits of add_sequence for its own fetches (bytes
moving, not bookkeeping), and the directory's traffic and size."""

from __future__ import annotations

import random
import statistics
import time

from tabulate import tabulate

from ..cache import create

SYSTEM = 16  # shared system prompts
SYSTEM_TOKENS = 256


def _config(world: int, tp: int, remote: bool) -> dict:
    # Blocks of 128 bytes: copying them costs next to nothing, so the figures are the
    # bookkeeping's (on a CPU machine the tier copies run inside the API calls).
    return {
        "model": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 2, "dtype": "float16"},
        "cache": {"tokens_per_block": 16, "device": "cpu", "gpu": {"blocks": 256},
                  "host": {"bytes": 2048 * 128}},
        "distributed": {"tp_size": tp, "consensus_timeout_s": 120,
                        "remote": {"enabled": remote, "fetch_timeout_ms": 100}},
    }


def _drive(cache, steps: int, seed: int) -> dict:
    """Admit two prompts a step (a system prompt and a question), decode each for four
    steps, release; per-step figures of this rank. ``cpu``: the thread's CPU time in
    the cache's calls (what preemption on an oversubscribed machine does not inflate)."""
    rng = random.Random(seed)
    systems = [[random.Random(s).randrange(50000) for _ in range(SYSTEM_TOKENS)] for s in range(SYSTEM)]
    prompts = [rng.choice(systems) + [rng.randrange(50000) for _ in range(rng.randrange(16, 200))]
               for _ in range(2 * steps)]
    decoded = [rng.randrange(50000) for _ in range(steps)]
    live: dict[int, int] = {}  # seq -> decode steps left
    sid = 0
    cpu = time.thread_time()
    for step in range(steps):
        cache.begin_step()
        for _ in range(2):
            cache.add_sequence(sid, prompts[sid])
            live[sid] = 4
            sid += 1
        for s in live:
            cache.append_tokens(s, [decoded[step]])
        cache.block_table(list(live))
        cache.end_step()
        for s in [s for s, left in live.items() if left == 1]:
            cache.release(s)
            del live[s]
        for s in live:
            live[s] -= 1
    cpu = time.thread_time() - cpu
    st = cache.stats()
    r = st["remote"]
    return {"cpu": cpu / steps, "bookkeeping": st["bookkeeping_seconds"] / steps,
            "upkeep": r.get("upkeep_seconds", 0.0) / steps,
            "agree": r.get("agree_seconds", 0.0) / steps,
            "pull": r.get("pull_seconds", 0.0) / steps,
            "remote_tokens": st["hit_tokens"].get("remote", 0),
            "reused": sum(st["hit_tokens"].values()), "prompt": st["prompt_tokens"],
            "messages": r.get("directory_messages_sent", 0) / steps,
            "message_bytes": r.get("directory_bytes_sent", 0) / steps,
            "directory_blocks": r.get("directory_blocks", 0), "directory_bytes": r.get("directory_bytes", 0),
            "metadata_bytes": st["metadata_bytes"]}


def run_upkeep(args, comm) -> int:
    world = comm.Get_size()
    tp = args.tp
    if world % tp or world // tp < 2:
        if comm.Get_rank() == 0:
            print(f"--upkeep needs at least two replicas of --tp {tp} ranks (world {world})")
        return 2
    rows = []
    for remote in (False, True):
        cache = create(_config(world, tp, remote), comm)
        try:
            mine = _drive(cache, args.steps, seed=cache.replica)
        finally:
            cache.close()
        everyone = comm.gather(mine, root=0)
        if comm.Get_rank() == 0:
            rows.append((remote, everyone))
    if comm.Get_rank() != 0:
        return 0
    med = statistics.median
    table = []
    base = med(e["bookkeeping"] for e in rows[0][1])
    for remote, everyone in rows:
        book = med(e["bookkeeping"] for e in everyone)
        upkeep, agree = med(e["upkeep"] for e in everyone), med(e["agree"] for e in everyone)
        reused = sum(e["reused"] for e in everyone[::tp])
        prompt = sum(e["prompt"] for e in everyone[::tp])
        cpu = med(e["cpu"] for e in everyone)
        cpu0 = med(e["cpu"] for e in rows[0][1])
        table.append(["sharing" if remote else "isolated",
                      f"{1e6 * cpu:.0f}" + (f" (+{100 * (cpu - cpu0) / cpu0:.0f}%)" if remote else ""),
                      f"{1e6 * book:.0f}",
                      f"{1e6 * upkeep:.0f}", f"{1e6 * agree:.0f}",
                      f"{100 * (upkeep + agree) / base:.1f}%" if remote else "-",
                      f"{1e6 * med(e['pull'] for e in everyone):.0f}",
                      f"{100 * reused / max(prompt, 1):.1f}%",
                      f"{sum(e['remote_tokens'] for e in everyone[::tp]):,}",
                      f"{med(e['messages'] for e in everyone):.1f}",
                      f"{med(e['message_bytes'] for e in everyone):,.0f}",
                      f"{med(e['directory_blocks'] for e in everyone):,.0f}",
                      f"{med(e['directory_bytes'] for e in everyone):,.0f}"])
    print(f"bench remote --upkeep: {world} ranks = {world // tp} replicas x TP {tp}, {args.steps} steps, "
          f"medians over ranks of per-step figures (µs)")
    print(tabulate(table, headers=["run", "API CPU", "bookkeeping", "dir. upkeep", "agreement", "added",
                                   "fetch waits", "reused", "remote tokens", "dir. msgs/step",
                                   "dir. bytes/step", "dir. blocks", "dir. bytes"], tablefmt="simple"))
    print("API CPU: the thread's CPU time in the cache's calls (the copies of these 128-byte blocks "
          "are negligible); bookkeeping, upkeep, agreement: wall time, which an oversubscribed "
          "machine inflates; added = (directory upkeep + agreement) / the isolated run's "
          "bookkeeping; the agreement's time includes waiting for the TP group's slowest rank")
    return 0
