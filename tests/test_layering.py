"""The package layering, read from the source's imports (function-level ones included):
no import cycles, the core never imports the bring-up package ``resihp.stack``, and no
service's logic does (a service's ``__main__`` may, for ``--all-jobs``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("resihp", "collector", "detector", "scheduler", "dashboard", "trainer")
SERVICES = PACKAGES[1:]
STACK = "resihp.stack"


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The first-party module ``name`` is, or is inside (``pkg.mod.attr`` -> ``pkg.mod``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:``: a type-only import
    never runs, so it makes no import edge."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            test = child.test if isinstance(child, ast.If) else None
            if isinstance(test, ast.Name | ast.Attribute) and "TYPE_CHECKING" in ast.unparse(test):
                todo.extend(child.orelse)
                continue
            todo.append(child)


def _imports(mod: str) -> set[str]:
    f = MODULES[mod]
    base = mod.split(".") if f.name == "__init__.py" else mod.split(".")[:-1]
    deps: set[str | None] = set()
    for node in _runtime_nodes(ast.parse(f.read_text())):
        if isinstance(node, ast.Import):
            deps |= {_owner(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                src = ".".join(base[: len(base) - node.level + 1] + [node.module or ""]).strip(".")
            else:
                src = node.module or ""
            for a in node.names:
                full = f"{src}.{a.name}"
                deps.add(full if full in MODULES else _owner(src))
    return {d for d in deps if d and d != mod}


GRAPH = {m: _imports(m) for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return out


def test_the_cycle_finder_finds_a_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(g) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back():
    assert "resihp.redis_client" in GRAPH["resihp.producer"]  # imported in a function
    assert _cycles(GRAPH) == []


def test_the_core_does_not_import_the_bring_up_package():
    core = [m for m in GRAPH if m.split(".")[0] == "resihp" and not m.startswith(STACK)]
    bad = {m: sorted(d for d in GRAPH[m] if d.startswith(STACK)) for m in core}
    assert {m: d for m, d in bad.items() if d} == {}


def test_no_service_logic_imports_the_bring_up_package():
    logic = [m for m in GRAPH if m.split(".")[0] in SERVICES and MODULES[m].name != "__main__.py"]
    assert len(logic) > 20
    bad = {m: sorted(d for d in GRAPH[m] if d.startswith(STACK)) for m in logic}
    assert {m: d for m, d in bad.items() if d} == {}
    # the entry points that run --all-jobs do use it
    assert "resihp.stack.jobwatch" in GRAPH["collector.__main__"]
