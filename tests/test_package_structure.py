"""The library's shape, read from its source with ``ast``: no import circles anywhere in
``kvdist/`` (counting imports inside functions and under ``TYPE_CHECKING`` too: a
circle of type hints is still two modules that cannot be read apart), and no module
reads another's private names: no ``from .x import _name``, and no ``obj._name`` on
anything but ``self``/``cls`` beyond the few listed below, each a name of another
library (torch, os) or of a class in the same module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "kvdist"

# obj._name reads that are not another kvdist module's state, by file.
ALLOWED_PRIVATE_READS = {
    "kvdist/bench/pin.py": {"torch._C"},  # torch's own
    "kvdist/bench/staging.py": {"torch.cuda._sleep"},
    "kvdist/process.py": {"os._exit"},
    "kvdist/sim/engine/attention.py": {"torch.ops.aten._flash_attention_forward"},
    "kvdist/sim/experiment/metrics.py": {"server._lock", "server._body"},  # its own server class
}


def _parse(path: Path) -> ast.Module:
    """``path``'s syntax tree; a file that cannot be read or parsed fails naming itself."""
    try:
        return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, ValueError, SyntaxError) as e:
        raise AssertionError(f"{path}: cannot be read as Python: {e!r}") from None


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for p in root.rglob("*.py"):
        parts = list(p.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (anywhere in its source)."""
    mods = _modules(root)
    top = root.name
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names = [f"{target}.{a.name}" for a in node.names]
                subs = [n for n in names if n in mods]  # from . import module
                deps.update(subs)
                if len(subs) < len(names):
                    deps.add(target)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d in mods and d != name and d.split(".")[0] == top}
    return graph


def circles(graph: dict[str, set[str]]) -> list[str]:
    """Every path from a module back to itself, each circle once (from its least module)."""
    found = []
    for start in sorted(graph):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    found.append(" -> ".join(path + [start]))
                elif nxt not in seen and nxt > start:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    return found


def private_reads(path: Path) -> set[str]:
    """``obj._name`` (not on self or cls, not dunder) and ``from x import _name`` in a file."""
    out = set()
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            out.add(ast.unparse(node))
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            out.update(f"from {node.module} import {a.name}" for a in node.names
                       if a.name.startswith("_") and not a.name.startswith("__"))
    return out


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root


def test_the_checks_find_what_they_must(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "from .b import f\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub import c\n",
        "sub/__init__.py": "",
        "sub/c.py": "def g():\n    from .. import a\n    return a._hidden, self._ok\n",
        "d.py": "from . import a\nfrom .b import _secret\n",
    })
    graph = import_graph(root)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.sub.c"] == {"pkg.a"}
    assert graph["pkg.d"] == {"pkg.a", "pkg.b"}
    assert circles(graph) == ["pkg.a -> pkg.b -> pkg.sub.c -> pkg.a"]
    assert private_reads(root / "sub" / "c.py") == {"a._hidden"}
    assert private_reads(root / "d.py") == {"from b import _secret"}


def test_no_import_circles_in_the_library():
    graph = import_graph(ROOT)
    assert len(graph) > 100 and graph["kvdist.cache"], "the graph must see the library"
    assert circles(graph) == []


def test_no_module_reads_another_modules_private_names():
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = str(path.relative_to(ROOT.parent))
        extra = private_reads(path) - ALLOWED_PRIVATE_READS.get(rel, set())
        if extra:
            found[rel] = sorted(extra)
    assert found == {}


def unnamed_encodings(path: Path) -> list[int]:
    """Lines of ``read_text``/``write_text`` calls and ``subprocess`` calls in text mode
    (``text=True``) that do not name their encoding: they read and write in the
    locale's, which on CI is ASCII (``open`` is checked by ruff's PLW1514 in make lint)."""
    out = []
    for node in ast.walk(_parse(path)):
        if not isinstance(node, ast.Call) or any(k.arg == "encoding" for k in node.keywords):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else ""
        text_mode = any(k.arg in ("text", "universal_newlines") and isinstance(k.value, ast.Constant)
                        and k.value.value is True for k in node.keywords)
        if name in ("read_text", "write_text") or text_mode:
            out.append(node.lineno)
    return out


def test_every_text_read_and_write_names_its_encoding(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("p.read_text()\np.write_text(s, encoding='utf-8')\nrun(a, text=True)\n",
                     encoding="utf-8")
    assert unnamed_encodings(probe) == [1, 3]
    top = ROOT.parent
    found = {str(p.relative_to(top)): lines for d in ("kvdist", "tests", "scripts", "launch")
             for p in sorted((top / d).rglob("*.py")) if (lines := unnamed_encodings(p))}
    assert found == {}
