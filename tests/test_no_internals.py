"""Code outside the library uses a cache through its public API: no test, script,
launcher or page of documentation reads a private attribute of a ``KVCache``, and
nothing can be patched onto a live one. What tests need inside goes through the test
seams handed over at construction (``kvdist.testing.create(cfg, Seams(...))``)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from kvdist.cache import KVCache

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", ".venv-vllm", "kvdist", "runs", "__pycache__", ".pytest_cache", ".ruff_cache"}
SUFFIXES = {".py", ".sh", ".md", ".yaml", ""}

# KVCache's private attributes, and the names under which its parts were once reachable.
PRIVATE = sorted(n for n in KVCache.__slots__ if n.startswith("_"))
FORMER = ("manager", "stager", "_local")
PATTERN = re.compile(r"\.(" + "|".join(map(re.escape, PRIVATE)) + r")\b"
                     r"|\b(?:\w*cache|c)\.(" + "|".join(map(re.escape, FORMER)) + r")\b")


def _files_outside_the_library() -> list[Path]:
    out = []
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        out += [Path(top, f) for f in files if Path(f).suffix in SUFFIXES]
    return out


def find_reaches(text: str) -> list[str]:
    return [m.group(0) for m in PATTERN.finditer(text)]


def test_the_pattern_finds_what_it_must():
    assert PRIVATE and "_manager" in PRIVATE and "_stager" in PRIVATE
    assert find_reaches("x = cache._manager.seqs; self.cache._stager; c._parts.host") == \
        ["._manager", "._stager", "._parts"]
    assert find_reaches("cache.manager.engine; big_cache.stager; c._local.host") == \
        ["cache.manager", "big_cache.stager", "c._local"]
    assert find_reaches("seams.manager.seqs; cache.stats(); cache.stage(a)") == []


def test_no_code_outside_the_library_reads_a_private_attribute_of_a_cache():
    files = _files_outside_the_library()
    assert any(f.name == "test_manager.py" for f in files) and any(f.name == "README.md" for f in files)
    me = Path(__file__).resolve()
    found = {}
    for f in files:
        if f.resolve() == me:
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        hits = find_reaches(text)
        if hits:
            found[str(f.relative_to(ROOT))] = hits
    assert found == {}, f"reaching inside a cache: {found}"


def test_nothing_can_be_patched_onto_a_cache(cfg_factory):
    import kvdist

    cache = kvdist.create(cfg_factory(gpu=4))
    try:
        with pytest.raises(AttributeError):
            cache.block_table = lambda ids: None
        with pytest.raises(AttributeError):
            cache.manager  # noqa: B018
    finally:
        cache.close()
