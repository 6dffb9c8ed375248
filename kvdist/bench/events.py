"""``python -m kvdist bench events``: what KV cache events cost the step. The trace of
``bench manager`` (16 prompts per batch, prefilled in one step, then 48 decode steps)
replayed through kvdist's :class:`~kvdist.manager.CacheManager` over GPU, host and disk
tiers, with events off, recording only, the publisher's thread idle and events on,
interleaved, side by side. Events on: the recorder (``kvdist.events``) hears every block
stored into, moved between and dropped from the tiers, each step's records are queued at
its end, and the publisher's thread builds, encodes and sends the batches on a loopback
PUB socket (with ``--subscriber``, a subscriber process reads them all). The idle thread
is the same thread, waking as often and sending a batch per step, but building no
event: what sharing the interpreter with it costs the step, whatever it does. The
replay never lets go of the interpreter (no GPU to wait for): the worst case for a
thread beside it. Only bookkeeping is timed: no tensors, no copies (the transfer engine
still orders every move)."""

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


OFF, RECORD, IDLE, ON = "events off", "recording only", "thread idle", "events on"


def run(trace, capacity: tuple[int, int, int], block_size: int, events: str,
        endpoint: str = "tcp://127.0.0.1:0") -> tuple[float, float, int, dict]:
    """Seconds of the whole replay (wall clock, and CPU of the thread that steps), the
    tier moves and drops it made, and the events' figures. ``RECORD``: the recorder on
    the pool and each step's records taken at its end, no publisher thread (the step's
    own share of ``ON``). ``IDLE``: ``ON`` with a publisher that builds no event (empty
    batches): the thread's presence alone."""
    layout = KVLayout(1, 1, 1, "float16", block_size)
    m = CacheManager(layout, capacity, NullExecutor())
    ev, after = None, None
    if events in (ON, IDLE):
        from ..events.channel import KVEvents
        ev = KVEvents(EventsConfig(enabled=True, endpoint=endpoint), 0, m,
                      build=(lambda records: []) if events == IDLE else None)
        after = ev.end_step
    elif events == RECORD:
        from ..events.recorder import BlockRecorder
        recorder = BlockRecorder(m.meta, m.tpb)
        m.pool.block_observer = recorder
        after = recorder.take
    driver = _Driver(m, after)
    gc.collect()
    cpu = time.thread_time()
    p, d = replay(trace, driver, m.begin_step, m.before_compute)
    cpu = time.thread_time() - cpu
    stats = {}
    if ev is not None:
        ev.close()
        stats = ev.stats()
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
                               text=True)
        sub.stdout.readline()
    modes = (OFF, RECORD, IDLE, ON)
    runs: dict[str, list[tuple[float, float]]] = {e: [] for e in modes}
    figures, moves, thread = {}, 0, []
    with tqdm(total=len(modes) * args.repeat, desc="replaying", leave=False) as bar:
        for _ in range(args.repeat):
            for events in modes:  # interleaved, so drift hits all alike
                wall, cpu, moves, f = run(trace, capacity, args.block_size, events, endpoint)
                runs[events].append((wall, cpu))
                if events in (ON, IDLE):
                    time.sleep(0.2)  # the port of the last run is free again
                if events == ON:
                    figures = f
                    thread.append(f["thread_seconds"])
                bar.update()
    received = None
    if sub is not None:
        received = int(sub.communicate(timeout=120)[0].split()[-1])
    steps = trace.steps
    wall = {e: min(w for w, _ in runs[e]) / steps * 1e6 for e in runs}
    cpu = {e: min(c for _, c in runs[e]) / steps * 1e6 for e in runs}
    rows = [[OFF, f"{wall[OFF]:.1f}", f"{cpu[OFF]:.1f}", "", "", ""]]
    for e in (RECORD, IDLE, ON):
        rows.append([e, f"{wall[e]:.1f}", f"{cpu[e]:.1f}", f"{cpu[e] - cpu[OFF]:+.2f}",
                     f"{(cpu[e] / cpu[OFF] - 1) * 100:+.1f}%",
                     f"{min(thread) / steps * 1e6:.1f}" if e == ON else ""])
    print(f"\nper-step bookkeeping, best of {args.repeat}; {figures['published']:,} batches a run, "
          f"{moves:,} tier moves and drops")
    print(tabulate(rows, headers=["", "wall µs/step", "step thread CPU µs/step", "added", "overhead",
                                  "publisher thread CPU µs/step"], disable_numparse=True))
    if received is not None:
        print(f"the subscriber process read {received:,} batches of the {2 * args.repeat} runs with a "
              "publisher (events on and thread idle, whose batches are empty; each run binds "
              "a new socket; what one sends before the subscriber has reconnected is lost to it)")
    overhead = cpu[ON] / cpu[OFF] - 1
    print(f"goal: events cost < 1% of the step thread's bookkeeping: {overhead * 100:.1f}% "
          f"{'PASS' if overhead < 0.01 else 'MISS'} (recording alone: "
          f"{(cpu[RECORD] / cpu[OFF] - 1) * 100:+.1f}%; with the thread idle beside it: "
          f"{(cpu[IDLE] / cpu[OFF] - 1) * 100:+.1f}%)")
    return 0
