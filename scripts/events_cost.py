"""The KV cache events' cost on the step thread, in instructions: ``bench events``'
trace (1,000 requests over GPU, host and disk tiers, 3,087 steps) replayed once, with
events off or on, for ``scripts/events_cost.sh`` to count under callgrind. Only the
replay is counted: it runs inside ``itertools.starmap``'s ``next``
(``--toggle-collect=starmap_next``), after the trace is built and the modules imported.

    python scripts/events_cost.py MODE   # off | proc-read (the cache's path) | record
"""

from __future__ import annotations

import itertools
import sys

import kvdist.events.channel  # noqa: F401  imported before the counted replay
import kvdist.events.recorder  # noqa: F401
from kvdist.bench import events as bench
from kvdist.bench.manager import make_trace

MODES = {"off": bench.OFF, "proc-read": bench.PROC_READ, "record": bench.RECORD}


def main() -> None:
    mode = MODES[sys.argv[1]]
    gpu = 4096
    trace = make_trace(1000, block_size=32, seed=0)
    replay = bench.replay
    bench.replay = lambda *args: next(itertools.starmap(replay, [args]))
    moved = bench.run(trace, (gpu, 2 * gpu, 4 * gpu), 32, mode)[2]
    print(f"{sys.argv[1]}: {moved} blocks moved or dropped")


if __name__ == "__main__":
    main()
