"""No import cycle among parallm's modules, counting imports inside functions.

A function-level import hides a cycle from Python (it resolves at call time) but not from a reader: the two
modules still depend on each other. The graph is built from the source with ``ast``: every ``import`` /
``from ... import`` anywhere in a module, relative ones resolved, ``from pkg import name`` counted as an import
of ``pkg.name`` when that is a module and of ``pkg`` otherwise. A package stands for its ``__init__``.
"""

from __future__ import annotations

import ast
import pathlib

import parallm

ROOT = pathlib.Path(parallm.__file__).parent


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        package = name if is_pkg else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
            for target in targets:
                while target and target not in modules:      # `import a.b.c` of an attribute: its module
                    target = target.rpartition(".")[0]
                if target and target != name and target.startswith("parallm"):
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_function_level_imports():
    """The builder itself: a function-level import is an edge (so a cycle through one would be found)."""
    graph = import_graph()
    assert "parallm.checkpoint.loader" in graph["parallm.checkpoint.saver"] or graph["parallm.checkpoint.saver"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles among parallm's modules:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_cycles_between_packages():
    """Between parallm's folders too (``model/`` imports ``parallel/``, which must not import ``model/`` back):
    the layering docs/design.md's "Depends on" column states."""
    graph = import_graph()
    top = lambda m: m.split(".")[1] if "." in m else m   # noqa: E731 - parallm.model.decoder -> model
    packages = {}
    for a, targets in graph.items():
        packages.setdefault(top(a), set()).update(top(b) for b in targets if top(b) != top(a))
    found = cycles(packages)
    assert not found, f"import cycles between parallm's folders: {found}"
    assert packages["parallel"] <= {"errors"}, packages["parallel"]
