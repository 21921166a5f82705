"""No two top-level packages of elaunch import each other (docs: DESIGN, "Dependencies point inward").

Every ``import`` in ``elaunch/`` is read with ``ast`` (function-level and ``TYPE_CHECKING``
imports too: they are dependencies all the same), mapped to the top-level package or
module of ``elaunch`` it reaches, and the graph between them must have no cycle.
"""

from __future__ import annotations

import ast
import pathlib

import elaunch

ROOT = pathlib.Path(elaunch.__file__).parent
#: Cycles still to break (none left: a cycle found later must be broken, not listed here).
KNOWN: set[tuple[str, ...]] = set()


def _top(parts: tuple[str, ...]) -> str:
    """The top-level name of ``elaunch`` a dotted module path (without ``elaunch``) lies in."""
    return parts[0] if parts else "__init__"


def _edges(root: pathlib.Path = ROOT) -> dict[tuple[str, str], list[str]]:
    """(importing top-level name, imported top-level name) -> the ``file:line`` of each such import."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("").parts
        package = rel[:-1]  # the package the file is in (an __init__.py: the package itself)
        source = _top(rel if rel[-1] != "__init__" else package)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name.split(".") for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ["elaunch", *package[:len(package) - node.level + 1]]
                    module = base + (node.module.split(".") if node.module else [])
                else:
                    module = (node.module or "").split(".")
                names = [module + [alias.name] for alias in node.names] if module == ["elaunch"] else [module]
            else:
                continue
            for name in names:
                if name[0] != "elaunch" or len(name) < 2:
                    continue
                target = name[1]
                if not (root / target).is_dir() and not (root / f"{target}.py").exists():
                    target = "__init__"  # a name of elaunch/__init__.py (``from elaunch import __version__``)
                if target != source:
                    edges.setdefault((source, target), []).append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return edges


def _cycles(edges) -> list[list[str]]:
    """Every elementary cycle's nodes, each once (smallest name first), shortest first."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    found: set[tuple[str, ...]] = set()

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                found.add(tuple(path))
            elif nxt > start and nxt not in path:
                walk(start, nxt, path + [nxt])

    for start in sorted(graph):
        walk(start, start, [start])
    return sorted((list(c) for c in found), key=lambda c: (len(c), c))


def _describe(cycle: list[str], edges) -> str:
    hops = zip(cycle, cycle[1:] + cycle[:1])
    return " -> ".join(cycle + cycle[:1]) + "  (" + "; ".join(f"{a}->{b}: {', '.join(edges[a, b][:3])}"
                                                          for a, b in hops) + ")"


def test_no_two_top_level_packages_import_each_other():
    edges = _edges()
    cycles = [c for c in _cycles(edges) if tuple(sorted(c)) not in KNOWN]
    assert not cycles, "top-level packages of elaunch import each other:\n" + "\n".join(
        _describe(c, edges) for c in cycles)


def test_known_cycles_still_exist():
    """A cycle broken leaves :data:`KNOWN`: remove it there, so that it cannot come back unseen."""
    cycles = {tuple(sorted(c)) for c in _cycles(_edges())}
    assert KNOWN <= cycles, f"no longer cycles, remove from KNOWN: {sorted(KNOWN - cycles)}"


def _module_edges(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of elaunch it imports when it runs (function-level imports too; not those under
    ``if TYPE_CHECKING:``, nor a module's own enclosing packages, which a submodule imports names from by
    Python's usual pattern)."""
    def name_of(path: pathlib.Path) -> str:
        rel = path.relative_to(root.parent).with_suffix("").parts
        return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)

    modules = {name_of(p): p for p in root.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test) for sub in node.body for n in ast.walk(sub)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    edges.setdefault(name, set()).add(target)
    return edges


def test_no_module_imports_itself_through_others():
    """No loop of imports between modules either (``farm-studio look`` draws them as circles): a loop that
    only works because its imports sit inside functions is still a loop. The checkpoint feature had one
    (``persisted`` took the DCP layout helpers from ``dcp``, which took ``persisted``'s paths back)."""
    edges = _module_edges()
    cycles = _cycles({(a, b): [] for a, targets in edges.items() for b in targets})
    assert not cycles, "modules of elaunch that import each other:\n" + "\n".join(" -> ".join(c) for c in cycles)
