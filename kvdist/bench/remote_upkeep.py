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


def _config(world: int, tp: int, remote: bool, every: int | None = None, batch: int = 8) -> dict:
    # Blocks of 128 bytes: copying them costs next to nothing, so the figures are the
    # bookkeeping's (on a CPU machine the tier copies run inside the API calls).
    return {
        "model": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 2, "dtype": "float16"},
        "cache": {"tokens_per_block": 16, "device": "cpu", "gpu": {"blocks": 32 * batch},
                  "host": {"bytes": 256 * batch * 128}},
        "distributed": {"tp_size": tp, "consensus_timeout_s": 120,
                        "remote": {"enabled": remote, "fetch_timeout_ms": 100,
                                   **({"directory_every_steps": every} if every else {})}},
    }


def _drive(cache, steps: int, seed: int, decode: int, admit: int) -> dict:
    """Admit ``admit`` prompts a step (a system prompt and a question), decode each for
    ``decode`` steps, release; per-step figures of this rank. CPU: the thread's CPU
    time in the cache's calls (what preemption on an oversubscribed machine does not
    inflate), in total and by phase: the step boundaries (``begin_step``/``end_step``:
    where the directory is kept and the TP group agrees), admissions (``add_sequence``:
    where remote blocks are looked up and fetched) and the rest."""
    rng = random.Random(seed)
    systems = [[random.Random(s).randrange(50000) for _ in range(SYSTEM_TOKENS)] for s in range(SYSTEM)]
    prompts = [rng.choice(systems) + [rng.randrange(50000) for _ in range(rng.randrange(16, 200))]
               for _ in range(admit * steps)]
    decoded = [rng.randrange(50000) for _ in range(steps)]
    live: dict[int, int] = {}  # seq -> decode steps left
    sid = 0
    clock = time.thread_time
    cpu = {"boundaries": 0.0, "admissions": 0.0, "rest": 0.0}
    for step in range(steps):
        t0 = clock()
        cache.begin_step()
        t1 = clock()
        for _ in range(admit):
            cache.add_sequence(sid, prompts[sid])
            live[sid] = decode
            sid += 1
        t2 = clock()
        for s in live:
            cache.append_tokens(s, [decoded[step]])
        cache.block_table(list(live))
        t3 = clock()
        cache.end_step()
        t4 = clock()
        for s in [s for s, left in live.items() if left == 1]:
            cache.release(s)
            del live[s]
        for s in live:
            live[s] -= 1
        t5 = clock()
        cpu["boundaries"] += (t1 - t0) + (t4 - t3)
        cpu["admissions"] += t2 - t1
        cpu["rest"] += (t3 - t2) + (t5 - t4)
    st = cache.stats()
    r = st["remote"]
    return {"cpu": sum(cpu.values()) / steps, **{k: v / steps for k, v in cpu.items()},
            "bookkeeping": st["bookkeeping_seconds"] / steps,
            "upkeep": r.get("upkeep_seconds", 0.0) / steps,
            "agree": r.get("agree_seconds", 0.0) / steps,
            "pull": r.get("pull_seconds", 0.0) / steps,
            "remote_tokens": st["hit_tokens"].get("remote", 0),
            "reused": sum(st["hit_tokens"].values()), "prompt": st["prompt_tokens"],
            "messages": r.get("directory_messages_sent", 0) / steps,
            "message_bytes": r.get("directory_bytes_sent", 0) / steps,
            "records": r.get("directory_records_applied", 0) / steps,
            "directory_blocks": r.get("directory_blocks", 0), "directory_bytes": r.get("directory_bytes", 0),
            "node_directory_bytes": r.get("node_directory_bytes", 0),
            "metadata_bytes": st["metadata_bytes"]}


def run_upkeep(args, comm) -> int:
    world = comm.Get_size()
    tp = args.tp
    if world % tp or world // tp < 2:
        if comm.Get_rank() == 0:
            print(f"--upkeep needs at least two replicas of --tp {tp} ranks (world {world})")
        return 2
    runs: dict[bool, list[list[dict]]] = {False: [], True: []}
    for _ in range(args.rounds):  # isolated and sharing alternate: both see the same load
        for remote in (False, True):
            cache = create(_config(world, tp, remote, args.every, args.admit * args.decode), comm)
            try:
                mine = _drive(cache, args.steps, cache.replica, args.decode, args.admit)
            finally:
                cache.close()
            everyone = comm.gather(mine, root=0)
            if comm.Get_rank() == 0:
                runs[remote].append(everyone)
    if comm.Get_rank() != 0:
        return 0
    med = statistics.median

    def fig(remote: bool, key: str) -> float:
        """Median over rounds of the median over ranks."""
        return med(med(e[key] for e in everyone) for everyone in runs[remote])

    base = fig(False, "cpu")
    table = []
    for remote in (False, True):
        last = runs[remote][-1]
        reused = sum(e["reused"] for e in last[::tp]) / max(sum(e["prompt"] for e in last[::tp]), 1)
        cpu, bound = fig(remote, "cpu"), fig(remote, "boundaries")
        table.append(["sharing" if remote else "isolated",
                      f"{1e6 * cpu:.0f}" + (f" (+{100 * (cpu - base) / base:.0f}%)" if remote else ""),
                      f"{1e6 * bound:.0f}" + (f" (+{100 * (bound - fig(False, 'boundaries')) / base:.0f}%)"
                                              if remote else ""),
                      f"{1e6 * fig(remote, 'admissions'):.0f}", f"{1e6 * fig(remote, 'rest'):.0f}",
                      f"{1e6 * fig(remote, 'agree'):.0f}",
                      f"{100 * reused:.1f}%",
                      f"{sum(e['remote_tokens'] for e in last[::tp]):,}",
                      f"{fig(remote, 'messages'):.2f}", f"{fig(remote, 'message_bytes'):,.0f}",
                      f"{fig(remote, 'records'):.0f}",
                      f"{fig(remote, 'directory_blocks'):,.0f}", f"{fig(remote, 'directory_bytes'):,.0f}",
                      f"{fig(remote, 'node_directory_bytes'):,.0f}"])
    every = args.every or _default_every()
    print(f"bench remote --upkeep: {world} ranks = {world // tp} replicas x TP {tp}, {args.steps} steps "
          f"of {args.admit} admissions (each decoded {args.decode} steps), directory messages every "
          f"{every} steps; medians over {args.rounds} rounds of the median over ranks, per step (us)")
    print(tabulate(table, headers=["run", "API CPU", "boundaries CPU", "admissions CPU", "rest CPU",
                                   "agreement wall", "reused", "remote tokens", "dir. msgs/step",
                                   "dir. bytes/step", "records applied/step", "dir. blocks", "dir. bytes",
                                   "node dir. bytes"],
                   tablefmt="simple"))
    print("CPU: the thread's CPU time in the cache's calls, by phase: boundaries = begin_step + "
          "end_step (keeping the directory: publishing stamps, sending, receiving and applying "
          "records; the TP group's agreement), admissions = add_sequence (looking blocks up, "
          "fetching them), rest = append_tokens, block_table, release; (+x%) = the increase over "
          "the isolated run's API CPU. Dir. bytes: this rank's mirror of the replicas that send it "
          "records; node dir. bytes: the node directory file it maps (one a node, shared by the "
          "node's ranks: replicas whole on one node list their blocks there instead of sending "
          "records). The stamp hooks on each host-tier change run inside the "
          "calls that change the tier (mostly admissions). Agreement wall: the MIN-reduces' wall "
          "time, which includes waiting for the TP group's slowest rank (on an oversubscribed "
          "machine, for a core)")
    return 0


def _default_every() -> int:
    from ..config import RemoteConfig

    return RemoteConfig().directory_every_steps
