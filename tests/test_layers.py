"""Layers point down only (DESIGN.md): checked on the import statements of the source."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def imported_modules(package: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[str(path.relative_to(ROOT))] = names
    return found


def test_storage_never_imports_delayd():
    offenders = {
        path: sorted(n for n in names if n == "delayd" or n.startswith("delayd."))
        for path, names in imported_modules("storage").items()
    }
    assert {p: n for p, n in offenders.items() if n} == {}
    assert len(offenders) >= 8  # the scan really saw the package


def test_storage_does_not_depend_on_trio_except_the_flusher():
    users = {
        path
        for path, names in imported_modules("storage").items()
        if any(n == "trio" or n.startswith("trio.") for n in names)
    }
    assert users == {"storage/flusher.py"}
