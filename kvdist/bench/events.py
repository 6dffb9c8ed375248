"""``python -m kvdist bench events``: what KV cache events cost the step. The trace of
``bench manager`` (16 prompts per batch, prefilled in one step, then 48 decode steps)
replayed through kvdist's :class:`~kvdist.manager.CacheManager` over GPU, host and disk
tiers, interleaved, side by side: events off; recording only (the recorder,
``kvdist.events``, hears every block stored into, moved between and dropped from the
tiers, and each step's records are handed over at its end to nobody); and each step's
records handed to a publisher — the cache's, a process of its own that reads them
where the pool wrote them, in shared memory (``kvdist.events.process``), or a thread
of the cache's process
(``kvdist.events.publisher``, as kvdist published before) — that builds, encodes and
sends the batches on a loopback PUB socket (with ``--subscriber``, a subscriber process
reads them all), or, idle, builds no event (empty batches: the publisher's presence
alone), or (a process only) reads the steps from the log and drops them: the step
thread's own share, recording and publishing. A control: events off with
a process beside it that keeps a CPU busy — on a machine of few cores (the dev box has
two) a process on the other core slows the step thread's CPU as the publisher's own
work does, whatever it is. Last, the events' own call on the step thread, each step's hand-over
timed (the cache's publisher): what the events' code itself takes of the step, whatever
else runs on the machine, but for the pool's writes of each change's words inside the
cache's calls. The replay never lets go of the interpreter (no GPU to wait for): the worst
case for a thread beside it. Only bookkeeping is timed: no tensors, no copies (the
transfer engine still orders every move). The step thread's CPU time is the figure
(``time.thread_time``); the publisher's own CPU (its thread's, or its process's) is
shown beside it."""

from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import time

from tabulate import tabulate
from tqdm import tqdm

from ..config import EventsConfig
from ..layout import KVLayout
from ..manager import CacheManager
from ..transfer.executors import NullExecutor
from .manager import make_trace, replay

_SUBSCRIBER = """
import sys, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.SUB); s.setsockopt(zmq.SUBSCRIBE, b""); s.connect(sys.argv[1])
n = 0
print("ready", flush=True)
while s.poll(30000):  # the runs without events in between take seconds
    s.recv_multipart(); n += 1
print(n, flush=True)
"""


class _Driver:
    """The manager's calls as ``replay`` makes them, the step boundary followed by
    ``after_end`` (the events' own, as KVCache.end_step does; nothing with events off)."""

    def __init__(self, m: CacheManager, after_end=None):
        self.add_sequence, self.append_tokens, self.table_rows = m.add_sequence, m.append_tokens, m.table_rows
        self.release, self._end, self._after = m.release, m.end_step, after_end

    def end_step(self) -> None:
        self._end()
        if self._after is not None:
            self._after()


class _Timed:
    """The step's hand-over timed (``time.perf_counter_ns`` around it, the pair's own
    cost taken off): the CPU the events' code itself takes on the step thread,
    whatever else runs on the machine — all of it but the pool's writes of each
    change's words (``BlockObserver``), inside the cache's calls, too short to time
    apart."""

    def __init__(self, recorder, end_step):
        self.ns, self.calls = 0, 0
        self.log, self.overflow = recorder.log, recorder.overflow  # the pool writes into the recorder's
        self.end_step = self._timed(end_step)

    def _timed(self, f):
        clock = time.perf_counter_ns

        def call(*args):
            t0 = clock()
            f(*args)
            self.ns += clock() - t0
            self.calls += 1
        return call

    @staticmethod
    def clock_ns() -> float:
        """What one timed call adds around the call itself (the two clock reads)."""
        clock, n = time.perf_counter_ns, 100_000
        t0 = clock()
        for _ in range(n):
            clock()
            clock()
        return (clock() - t0) / n


OFF, RECORD = "events off", "recording only"
BUSY = "events off, a busy process beside"
PROC_READ, PROC_IDLE, PROC = "process, reading only", "process, idle", "process (the cache's)"
THREAD_IDLE, THREAD = "thread, idle", "thread (before)"
PUBLISHERS = {PROC_READ: ("process", "none"), PROC_IDLE: ("process", "empty"), PROC: ("process", "events"),
              THREAD_IDLE: ("thread", "empty"), THREAD: ("thread", "events")}
_BUSY = "while True: pass"  # BUSY's neighbour: a whole CPU


def run(trace, capacity: tuple[int, int, int], block_size: int, events: str,
        endpoint: str = "tcp://127.0.0.1:0", timed: bool = False) -> tuple[float, float, int, dict]:
    """Seconds of the whole replay (wall clock, and CPU of the thread that steps), the
    tier moves and drops it made, and the events' figures (``events``: one of the
    modes above). ``timed``: the events' hand-over on the step thread timed each step
    (``_Timed``: the hand-over; the figures gain ``timed_ns`` and ``timed_calls``)."""
    layout = KVLayout(1, 1, 1, "float16", block_size)
    m = CacheManager(layout, capacity, NullExecutor())
    ev, after, busy = None, None, None
    if events == BUSY:
        busy = subprocess.Popen([sys.executable, "-c", _BUSY])
        time.sleep(0.2)  # started
    if events in PUBLISHERS:
        from ..events.channel import KVEvents
        publisher, build = PUBLISHERS[events]
        ev = KVEvents(EventsConfig(enabled=True, endpoint=endpoint), 0, m, publisher=publisher, build=build)
        after = ev.end_step
        if timed:
            clocked = _Timed(ev.recorder, ev.end_step)
            m.pool.block_observer = clocked
            after = clocked.end_step
    elif events == RECORD:
        from ..events.recorder import BlockRecorder
        recorder = BlockRecorder()
        m.pool.block_observer = recorder
        after = recorder.skip
    driver = _Driver(m, after)
    gc.collect()
    cpu = time.thread_time()
    p, d = replay(trace, driver, m.begin_step, m.before_compute)
    cpu = time.thread_time() - cpu
    if busy is not None:
        busy.kill()
        busy.wait()
    stats = {}
    if ev is not None:
        ev.close()
        stats = ev.stats()
        if timed:
            stats |= {"timed_ns": clocked.ns, "timed_calls": clocked.calls}
    moved = sum(m.counters.blocks_moved.values())
    return float(p.sum() + d.sum()), cpu, moved + m.counters.dropped, stats


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvdist bench events", description=__doc__)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--gpu-blocks", type=int, default=4096)
    ap.add_argument("--host-ratio", type=int, default=2, help="host tier: this many times the GPU blocks")
    ap.add_argument("--disk-ratio", type=int, default=4, help="disk tier: this many times the GPU blocks")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=7, help="runs of each, interleaved; the fastest counts")
    ap.add_argument("--subscriber", action="store_true",
                    help="a subscriber process on the PUB socket reads every batch")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    g = args.gpu_blocks
    capacity = (g, g * args.host_ratio, g * args.disk_ratio)
    trace = make_trace(args.requests, block_size=args.block_size, seed=args.seed)
    print(f"trace: {trace.requests} requests, {trace.prompt_tokens:,} prompt tokens, {trace.steps:,} steps, "
          f"{args.block_size}-token blocks; tiers (blocks): gpu {capacity[0]:,}, host {capacity[1]:,}, "
          f"disk {capacity[2]:,}")
    endpoint, sub = "tcp://127.0.0.1:0", None
    if args.subscriber:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        endpoint = f"tcp://127.0.0.1:{port}"
        sub = subprocess.Popen([sys.executable, "-c", _SUBSCRIBER, endpoint], stdout=subprocess.PIPE,
                               text=True, encoding="utf-8")
        sub.stdout.readline()
    modes = (OFF, RECORD, PROC_READ, PROC_IDLE, PROC, THREAD_IDLE, THREAD, BUSY)
    runs: dict[str, list[tuple[float, float]]] = {e: [] for e in modes}
    figures: dict[str, dict] = {}
    pub_cpu: dict[str, list[float]] = {e: [] for e in PUBLISHERS}
    moves = 0
    with tqdm(total=len(modes) * args.repeat, desc="replaying", leave=False) as bar:
        for _ in range(args.repeat):
            for events in modes:  # interleaved, so drift hits all alike
                wall, cpu, moves, f = run(trace, capacity, args.block_size, events, endpoint)
                runs[events].append((wall, cpu))
                if events in PUBLISHERS:
                    time.sleep(0.2)  # the port of the last run is free again
                    figures[events] = f
                    pub_cpu[events].append(f["publisher_seconds"])
                    assert (f["published"] == (0 if events == PROC_READ else f["submitted"])
                            and f["dropped"] == 0), f"{events}: batches lost: {f}"
                bar.update()
    direct = []  # the events' hand-over on the step thread, µs a step (the cache's publisher)
    clock_ns = _Timed.clock_ns()
    for _ in range(args.repeat):
        f = run(trace, capacity, args.block_size, PROC, endpoint, timed=True)[3]
        direct.append((f["timed_ns"] - f["timed_calls"] * clock_ns) / 1e3 / trace.steps)
        time.sleep(0.2)
    received = None
    if sub is not None:
        received = int(sub.communicate(timeout=120)[0].split()[-1])
    steps = trace.steps
    wall = {e: min(w for w, _ in runs[e]) / steps * 1e6 for e in runs}
    cpu = {e: min(c for _, c in runs[e]) / steps * 1e6 for e in runs}
    rows = [[OFF, f"{wall[OFF]:.1f}", f"{cpu[OFF]:.1f}", "", "", ""]]  # the others against it
    for e in modes[1:]:
        rows.append([e, f"{wall[e]:.1f}", f"{cpu[e]:.1f}", f"{cpu[e] - cpu[OFF]:+.2f}",
                     f"{(cpu[e] / cpu[OFF] - 1) * 100:+.1f}%",
                     f"{min(pub_cpu[e]) / steps * 1e6:.1f}" if e in PUBLISHERS else ""])
    f = figures[PROC]
    print(f"\nper-step bookkeeping, best of {args.repeat}; {f['published']:,} batches a run (each run's "
          f"every one published: none dropped), {moves:,} tier moves and drops")
    print(tabulate(rows, headers=["", "wall µs/step", "step thread CPU µs/step", "added", "overhead",
                                  "publisher CPU µs/step"], disable_numparse=True))
    if received is not None:
        print(f"the subscriber process read {received:,} batches of the {len(PUBLISHERS) * args.repeat} runs "
              "with a publisher (the idle ones' batches are empty; each run binds a new socket; what one "
              "sends before the subscriber has reconnected is lost to it)")
    own_us = min(direct)
    print(f"the events' own call on the step thread (the step's records ended and published, timed "
          f"each step, best of {args.repeat}; the pool's writes inside the cache's calls not included): "
          f"{own_us:.2f} µs a step, {own_us / cpu[OFF] * 100:.2f}% of the step with events off")

    def pct(e: str) -> str:
        return f"{(cpu[e] / cpu[OFF] - 1) * 100:+.1f}%"

    overhead = cpu[PROC] / cpu[OFF] - 1
    own = cpu[PROC_READ] / cpu[OFF] - 1
    off_cpu = [c for _, c in runs[OFF]]
    spread = max(off_cpu) / min(off_cpu) - 1  # events off against itself: what the box's noise is
    resolved = args.repeat >= 3 and spread < 0.01

    def verdict(x: float) -> str:
        if not resolved:
            return "(cannot tell)"
        return "PASS" if x < 0.01 else "MISS"

    if not resolved:
        print(f"events off's own {args.repeat} run(s) spread {spread * 100:.1f}%: "
              f"{'more than the goal' if args.repeat >= 3 else 'too few runs to tell'}, so the verdicts "
              "below cannot tell 1% (on a shared or small box, count instructions instead: docs/design.md, "
              "\"KV cache events\")")
    print(f"goal: events cost < 1% of the step thread's bookkeeping: {overhead * 100:+.1f}% "
          f"{verdict(overhead)}; the step thread's own share (recording and "
          f"publishing, the child only draining the log): {own * 100:+.1f}% "
          f"{verdict(own)}. "
          f"Recording alone: {pct(RECORD)}; the publisher in a thread instead: {pct(THREAD)}; the step "
          f"with events off beside a process that keeps a CPU busy: {pct(BUSY)} (on a machine of few "
          f"cores, what the publisher's own CPU costs the step)")
    return 0
