"""Shared-memory files a killed job leaves on the launching node: MPICH's segments
(``mpich_shm_*``: MPICH unlinks its own in an exit handler, which a killed rank never
runs) and the remote tier's (``kvdist-*``, named until every peer has mapped them).
After the job, the launcher removes those that appeared during it and that no live
process maps; each rank's watcher does the same on its node (``rank_watcher.py``), so
other nodes and a killed launcher are covered too."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from pathlib import Path

from .rank_watcher import LEFTOVER_PREFIXES

__all__ = ["mapped_segments", "remove_leftovers", "shm_segments"]


def shm_segments(shm: Path = Path("/dev/shm")) -> set[Path]:
    """This user's files of ``shm`` named like MPICH's or kvdist's segments."""
    out = set()
    for p in shm.iterdir():
        if p.name.startswith(LEFTOVER_PREFIXES):
            with contextlib.suppress(OSError):  # gone meanwhile
                if p.stat().st_uid == os.geteuid():
                    out.add(p)
    return out


def mapped_segments(shm: Path, proc: Path, pids: Iterable[int] | None = None) -> set[Path]:
    """The files of ``shm`` that some live process maps (of ``pids`` only, when given)."""
    mapped, at = set(), f"{shm}/"
    for maps in proc.glob("[0-9]*/maps") if pids is None else (proc / str(pid) / "maps" for pid in pids):
        try:
            lines = maps.read_text(encoding="utf-8").splitlines()
        except OSError:  # gone, or not ours (then neither are its segments)
            continue
        mapped |= {Path(ln[ln.index(at):].removesuffix(" (deleted)")) for ln in lines if at in ln}
    return mapped


def remove_leftovers(before: set[Path], shm: Path = Path("/dev/shm"), proc: Path = Path("/proc"),
                     grace_s: float = 2.0) -> int:
    """Remove the segments that appeared since ``before`` and that no live process maps
    (another job's stay); returns how many went. Ranks mpiexec killed may still be
    exiting, mapping theirs: up to ``grace_s`` for them to go."""
    new = shm_segments(shm) - before
    held = new & mapped_segments(shm, proc) if new else set()
    deadline = time.monotonic() + grace_s
    while held and time.monotonic() < deadline:
        time.sleep(0.05)
        held &= mapped_segments(shm, proc)
    gone = 0
    for p in new - held:
        try:
            p.unlink()
            gone += 1
        except OSError:
            pass
    return gone
