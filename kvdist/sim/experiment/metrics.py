"""What the run measures over time (for the plots and results.json), and the optional
Prometheus endpoint that serves the latest figures (rank 0, stdlib only)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ...blocks import TIER_NAMES as TIERS
from ...transfer.routes import ROUTE_NAMES as MOVES


@dataclass(slots=True)
class Timeline:
    """Cumulative counters after every step (rank 0's cache; ranks decide alike)."""

    capacity: dict[str, int]
    prompt_tokens: list[int] = field(default_factory=list)
    reused: dict[str, list[int]] = field(default_factory=lambda: {t: [] for t in TIERS})
    reused_gpu_only: list[int] = field(default_factory=list)
    used: dict[str, list[int]] = field(default_factory=lambda: {t: [] for t in TIERS})
    moved: dict[str, list[int]] = field(default_factory=lambda: {m: [] for m in MOVES})  # blocks
    finished: list[int] = field(default_factory=list)

    def record(self, stats: dict, gpu_only_reused: int | None, finished: int) -> None:
        """One step's counters; ``gpu_only_reused`` from the replay (None: no replay)."""
        self.prompt_tokens.append(stats["prompt_tokens"])
        for t in TIERS:
            self.reused[t].append(stats["hit_tokens"].get(t, 0))
            self.used[t].append(stats["blocks_used"].get(t, 0))
        for m in MOVES:
            self.moved[m].append(stats["blocks_moved"].get(m, 0))
        if gpu_only_reused is not None:
            self.reused_gpu_only.append(gpu_only_reused)
        self.finished.append(finished)

    @property
    def steps(self) -> int:
        return len(self.prompt_tokens)

    def to_json(self) -> dict:
        return {"capacity_blocks": self.capacity, "prompt_tokens": self.prompt_tokens,
                "reused_tokens": self.reused, "reused_tokens_gpu_only": self.reused_gpu_only,
                "blocks_used": self.used, "blocks_moved": self.moved, "finished": self.finished}


def _number(value: int | float) -> str:
    """A sample value: ints exactly (a byte counter past 1e6 must not lose digits),
    floats in their shortest exact form."""
    return str(value) if isinstance(value, int) else repr(float(value))


def exposition(snapshot: dict[str, tuple[str, str, list[tuple[dict[str, str], float]]]]) -> str:
    """Prometheus text format: ``{name: (type, help, [(labels, value), ...])}``."""
    lines = []
    for name, (kind, text, samples) in snapshot.items():
        lines.append(f"# HELP {name} {text}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
            lines.append(f"{name}{{{lab}}} {_number(value)}" if lab else f"{name} {_number(value)}")
    return "\n".join(lines) + "\n"


def snapshot_from(stats: dict, requests_done: int, mismatches: int) -> dict:
    """The metrics of one moment of the run, from ``cache.stats()``."""
    bpb = stats["block_bytes"]
    return {
        "kvdist_requests_finished_total": ("counter", "Requests that finished.",
                                           [({}, requests_done)]),
        "kvdist_steps_total": ("counter", "Scheduler steps.", [({}, stats["steps"])]),
        "kvdist_prompt_tokens_total": ("counter", "Prompt tokens admitted.",
                                       [({}, stats["prompt_tokens"])]),
        "kvdist_reused_tokens_total": ("counter", "Prompt tokens reused, by the tier they were found in.",
                                       [({"tier": t}, v) for t, v in stats["hit_tokens"].items()]),
        "kvdist_blocks_used": ("gauge", "Blocks in use per tier.",
                               [({"tier": t}, v) for t, v in stats["blocks_used"].items()]),
        "kvdist_blocks_capacity": ("gauge", "Blocks per tier.",
                                   [({"tier": t}, v) for t, v in stats["capacity_blocks"].items()]),
        "kvdist_bytes_moved_total": ("counter", "Bytes copied between tiers, by direction.",
                                     [({"direction": m}, n * bpb) for m, n in stats["blocks_moved"].items()]),
        "kvdist_transfer_seconds_total": ("counter", "Seconds spent submitting and running copies.",
                                          [({}, stats["transfer_seconds"])]),
        "kvdist_integrity_mismatches_total": ("counter", "Reused blocks whose bytes were wrong.",
                                              [({}, mismatches)]),
    }


class MetricsServer:
    """Serves ``/metrics`` from a background thread; ``update`` swaps the snapshot.
    Listens on ``host`` (loopback unless the operator opens it with --metrics-host)."""

    def __init__(self, port: int, host: str = "127.0.0.1"):
        self._lock = threading.Lock()
        self._body = b"# no step has run yet\n"
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                with server._lock:
                    body = server._body
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # scrapes are not worth a log line
                pass

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="kvdist-metrics",
                                        daemon=True)
        self._thread.start()

    def update(self, snapshot: dict) -> None:
        body = exposition(snapshot).encode()
        with self._lock:
            self._body = body

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
