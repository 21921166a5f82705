"""Measure elaunch's design against issue 23's targets, from the code (a measure, not a gate).

Run from the repository root::

    .venv/bin/python scripts/measure_design.py

Prints, each with its target and whether it is met:

* the modules under ``elaunch/`` naming each of a few options (target: at most 4 each);
* ``RendezvousHandler``'s public methods in ``elaunch/rendezvous/contract.py`` (target: at most 10);
* functions over 60 lines and modules over 400 lines (target: none);
* modules with the same file name (``__init__.py`` and ``__main__.py`` aside; target: none);
* the package's total lines.

Always exits 0. Stdlib only; nothing is imported from the package.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "elaunch"
OPTIONS = ("hang_timeout", "monitor_interval", "shutdown_timeout", "forward_signals")
MAX_OPTION_FILES, MAX_HANDLER_METHODS, MAX_FUNCTION_LINES, MAX_MODULE_LINES = 4, 10, 60, 400


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def _modules() -> dict[str, str]:
    """Path relative to the repository -> text, for every module of the package."""
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def _option_files(modules: dict[str, str]) -> None:
    for option in OPTIONS:
        word = re.compile(rf"\b{option}\b")
        files = [path for path, text in modules.items() if word.search(text)]
        print(f"option {option}: {len(files)} modules (target <= {MAX_OPTION_FILES}: "
              f"{_verdict(len(files) <= MAX_OPTION_FILES)})")
        for path in files:
            print(f"    {path}")


def _handler_methods() -> None:
    tree = ast.parse((PACKAGE / "rendezvous" / "contract.py").read_text())
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RendezvousHandler"), None)
    methods = [] if cls is None else [
        n.name for n in cls.body
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not n.name.startswith("_")]
    print(f"RendezvousHandler public methods: {len(methods)} (target <= {MAX_HANDLER_METHODS}: "
          f"{_verdict(len(methods) <= MAX_HANDLER_METHODS)})")
    print(f"    {', '.join(methods)}")


def _long_functions(modules: dict[str, str]) -> None:
    long = []
    for path, text in modules.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{path}:{node.lineno} {node.name} ({length} lines)")
    print(f"functions over {MAX_FUNCTION_LINES} lines: {len(long)} (target 0: {_verdict(not long)})")
    for line in long:
        print(f"    {line}")


def _long_modules(modules: dict[str, str]) -> None:
    long = [f"{path} ({len(text.splitlines())} lines)" for path, text in modules.items()
            if len(text.splitlines()) > MAX_MODULE_LINES]
    print(f"modules over {MAX_MODULE_LINES} lines: {len(long)} (target 0: {_verdict(not long)})")
    for line in long:
        print(f"    {line}")


def _same_names(modules: dict[str, str]) -> None:
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in modules:
        name = Path(path).name
        if name not in ("__init__.py", "__main__.py"):
            by_name[name].append(path)
    same = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    print(f"module names used twice or more: {len(same)} (target 0: {_verdict(not same)})")
    for name, paths in sorted(same.items()):
        print(f"    {name}: {', '.join(paths)}")


def main() -> int:
    modules = _modules()
    _option_files(modules)
    _handler_methods()
    _long_functions(modules)
    _long_modules(modules)
    _same_names(modules)
    total = sum(len(text.splitlines()) for text in modules.values())
    print(f"package lines: {total} in {len(modules)} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
