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


REPLICATION_MAY_IMPORT = (
    "storage",
    "delayd.replication",
    "delayd.protocol",
    "delayd.logs",
    "delayd.serving",
    "delayd.cluster",
    "delayd.errors",
    "delayd.version",
)


def test_replication_imports_only_the_layers_below_it():
    """Replication copies logs between members; the servers, the broker, the clients
    and the CLI sit above it and wire it in."""
    offenders = {
        path: sorted(
            name
            for name in names
            if (name == "delayd" or name.startswith("delayd."))
            and not any(name == ok or name.startswith(ok + ".") for ok in REPLICATION_MAY_IMPORT)
        )
        for path, names in imported_modules("delayd/replication").items()
    }
    assert {p: n for p, n in offenders.items() if n} == {}
    assert len(offenders) >= 6  # the scan really saw the package


# A module or package -> the delayd modules it may import (a name and what is under it).
MAY_IMPORT = {
    # TLS rules shared by the clients and the servers: a leaf beside errors.
    "delayd/tls.py": ("delayd.errors",),
    # The servers' TLS: the listeners' side, over the shared rules.
    "delayd/serving/tls.py": ("delayd.tls", "delayd.serving.connection_gate"),
}


def test_modules_import_only_what_their_row_allows():
    found = {}
    for source, allowed in MAY_IMPORT.items():
        package = source.rpartition("/")[0]
        names = imported_modules(package)[source]
        found[source] = sorted(
            n
            for n in names
            if (n == "delayd" or n.startswith("delayd."))
            and not any(n == ok or n.startswith(ok + ".") for ok in allowed)
        )
    assert {p: n for p, n in found.items() if n} == {}


def test_clients_do_not_import_the_servers_hosting():
    """A client (delayd.client) connects over TLS with delayd.tls alone, never through
    what hosts the servers (delayd.serving)."""
    offenders = {
        path: sorted(n for n in names if n == "delayd.serving" or n.startswith("delayd.serving."))
        for path, names in imported_modules("delayd/client").items()
    }
    assert {p: n for p, n in offenders.items() if n} == {}
    assert len(offenders) >= 10  # the scan really saw the package
