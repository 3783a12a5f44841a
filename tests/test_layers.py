"""Layers point down only (DESIGN.md, "Layers"): one table says, for every package and
root module, what it may import from delayd and storage, and the import statements of
the source must keep to it. A package or root module without a row fails the test, so
a new one has to be placed in the table."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
from collections.abc import Iterable, Mapping

ROOT = pathlib.Path(__file__).resolve().parent.parent

# A unit is ``storage``, the package root ``delayd`` (its __init__, which re-exports the
# clients), or ``delayd.X``: a package with all its modules, or a root module.

# Leaf modules import nothing from delayd; every delayd unit may import them.
LEAVES = (
    "delayd.version",
    "delayd.address",
    "delayd.durations",
    "delayd.timestamps",
    "delayd.message_ids",
    "delayd.structured_logs",
    "delayd.nowait_acquire",
)
# What delivery builds on: the due entries and the logs it reads and writes.
DELIVERY = (
    "storage",
    "delayd.errors",
    "delayd.protocol",
    "delayd.write_refusals",
    "delayd.logs",
    "delayd.wheel",
)
# What the delay server builds on: the process that runs intake, replay, the wheel, the
# sender, the embedded broker, the HTTP API and replication.
SERVER = (
    *DELIVERY,
    "delayd.cluster",
    "delayd.replay",
    "delayd.tls",
    "delayd.serving",
    "delayd.replication",
    "delayd.broker",
    "delayd.sender",
)

# Bottom-up: a row may name only rows above it (lower layers), so the table is itself
# the proof that the layers point down.
ROWS: list[tuple[str, Iterable[str]]] = [
    ("storage", ()),
    *((leaf, ()) for leaf in LEAVES),
    ("delayd.errors", ["storage"]),
    ("delayd.protocol", ["delayd.errors"]),
    # TLS rules the clients and the servers share (files, ClientTls, handshake errors);
    # the listeners' side is delayd.serving's.
    ("delayd.tls", ["delayd.errors"]),
    ("delayd.write_refusals", ["storage"]),  # which logs refuse writes on a full disk
    ("delayd.logs", ["storage"]),
    ("delayd.wheel", ["storage", "delayd.logs"]),
    ("delayd.replay", ["storage", "delayd.errors", "delayd.logs", "delayd.write_refusals"]),
    # What hosts the two servers: only they (and the commands) build on it.
    # "h1:p1,h2:p2" and "etcd://h:p/GROUP": built on the one HOST:PORT rule (a leaf).
    ("delayd.group_address", []),
    # etcd, membership and election: a group's members, the servers and the clients that
    # find its leader build on it.
    ("delayd.cluster", ["delayd.errors", "delayd.group_address"]),
    (
        "delayd.serving",
        [
            "storage",
            "delayd.errors",
            "delayd.protocol",
            "delayd.tls",
            "delayd.write_refusals",
            "delayd.cluster",
        ],
    ),
    # Copies a member's logs to the others; the servers sit above it and wire it in.
    (
        "delayd.replication",
        [
            "storage",
            "delayd.errors",
            "delayd.protocol",
            "delayd.logs",
            "delayd.tls",
            "delayd.serving",
            "delayd.cluster",
        ],
    ),
    (
        "delayd.client",
        [
            "delayd.errors",
            "delayd.protocol",
            "delayd.tls",
            "delayd.group_address",
            "delayd.cluster",
        ],
    ),
    ("delayd", ["delayd.client", "delayd.errors", "delayd.protocol"]),  # its public names
    (
        "delayd.broker",
        ["storage", "delayd.errors", "delayd.protocol", "delayd.write_refusals", "delayd.serving"],
    ),
    (
        "delayd.sender",
        # the embedded broker is a target; broker groups may be found in etcd
        [*DELIVERY, "delayd.tls", "delayd.broker", "delayd.cluster", "delayd.group_address"],
    ),
    ("delayd.server", SERVER),  # with its HTTP API (delayd.server.http)
    ("delayd.inspect", ["storage", "delayd.logs", "delayd.wheel", "delayd.replay"]),
    ("delayd.top", ["delayd.logs"]),
    ("delayd.audit", ["storage", "delayd.logs", "delayd.replay"]),
    ("delayd.bench", ["delayd", "delayd.protocol"]),
]
ROWS += [
    ("delayd.cli", [name for name, _ in ROWS]),  # the commands: on top, imported by none
    ("delayd.__main__", ["delayd.cli"]),
]
RULES: dict[str, frozenset[str]] = {name: frozenset(allowed) for name, allowed in ROWS}

# Imports that break the table and pass all the same, by unit pair: none. When one
# appears, move the code to the layer it belongs to rather than list the pair here.
TOLERATED: set[tuple[str, str]] = set()


def module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str | None:
    """The unit a module of delayd or storage belongs to; None for any other module."""
    parts = module.split(".")
    if parts[0] == "storage":
        return "storage"
    if parts[0] != "delayd":
        return None
    return ".".join(parts[:2])


def imported_names(path: pathlib.Path, root: pathlib.Path = ROOT) -> set[str]:
    """Every module an import statement in the file names (also inside functions and
    ``if TYPE_CHECKING``: a type is a dependency too), relative ones made absolute.
    ``from delayd import X`` names ``delayd.X`` when X is a unit, else the package root
    (``__version__``, the re-exported clients)."""
    module = module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # 1: this package, 2: its parent, ...
                parts = package.split(".")
                above = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{above}.{base}" if base else above
            if base == "delayd" or not node.module:
                names.update(
                    f"{base}.{a.name}" if f"{base}.{a.name}" in RULES or node.level else base
                    for a in node.names
                )
            else:
                names.add(base)
    return names


def source_imports(*packages: str) -> dict[str, set[str]]:
    """Module name -> the modules it imports, for every module under ``packages``."""
    return {
        module_name(path): imported_names(path)
        for package in packages
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def units_in_tree(root: pathlib.Path = ROOT) -> set[str]:
    units = {"storage", "delayd"}
    for entry in (root / "delayd").iterdir():
        if entry.suffix == ".py" and entry.stem != "__init__":
            units.add(f"delayd.{entry.stem}")
        elif entry.is_dir() and any(entry.glob("*.py")):
            units.add(f"delayd.{entry.name}")
    return units


def violations(
    imports: Mapping[str, Iterable[str]],
    rules: Mapping[str, frozenset[str]] = RULES,
    tolerated: set[tuple[str, str]] = TOLERATED,
) -> list[str]:
    """What breaks the table: an import its unit's row does not allow, and a module
    whose unit, or an imported unit, has no row."""
    found = []
    for module, names in sorted(imports.items()):
        unit = unit_of(module)
        if unit not in rules:
            found.append(f"{module}: {unit} has no row in the layer table")
            continue
        allowed = rules[unit] | (set(LEAVES) if unit != "storage" else set())
        for name in sorted(names):
            target = unit_of(name)
            if target is None or target == unit or (unit, target) in tolerated:
                continue
            if target not in rules:
                found.append(f"{module} imports {name}: {target} has no row in the layer table")
            elif target not in allowed:
                found.append(f"{module} imports {name}: {unit} may not import {target}")
    return found


def test_every_import_keeps_to_the_table():
    imports = source_imports("delayd", "storage")
    assert len(imports) > 150  # the scan really read the tree
    assert violations(imports) == []


def test_every_package_and_root_module_has_a_row():
    assert sorted(units_in_tree() - RULES.keys()) == []


def test_every_row_names_a_unit_of_the_tree():
    assert sorted(RULES.keys() - units_in_tree()) == []


def test_rows_name_only_rows_above_them():
    """The table is ordered bottom-up, so allowing only earlier rows keeps every layer
    pointing down: no two units may import each other, directly or round a cycle."""
    seen: set[str] = set()
    upward = []
    for name, allowed in RULES.items():
        upward += [f"{name} -> {a}" for a in sorted(allowed - seen)]
        seen.add(name)
    assert upward == []


def test_the_clients_and_storage_stay_out_of_the_servers():
    assert not RULES["delayd.client"] & {"delayd.server", "delayd.broker", "delayd.wheel"}
    assert RULES["storage"] == frozenset()
    using_the_cli = sorted(name for name, allowed in RULES.items() if "delayd.cli" in allowed)
    assert using_the_cli == ["delayd.__main__"]
    using_serving = {name for name, allowed in RULES.items() if "delayd.serving" in allowed}
    assert using_serving == {"delayd.server", "delayd.broker", "delayd.replication", "delayd.cli"}


def test_the_checker_catches_what_the_table_forbids():
    fake = {
        "delayd.client.producer": {"delayd.server.app", "delayd.protocol", "trio"},
        "delayd.logs.message_log": {"storage.framing", "delayd.wheel.timer"},
        "delayd.teleport": {"delayd.protocol"},
        "delayd.top.model": {"delayd.teleport.beam"},
        "storage.segment": {"delayd.errors"},
        "delayd.audit.files": {"delayd.version", "delayd.durations"},
        "delayd.sender.targets": {"delayd"},
    }
    assert violations(fake, tolerated=set()) == [
        "delayd.client.producer imports delayd.server.app: delayd.client may not import "
        "delayd.server",
        "delayd.logs.message_log imports delayd.wheel.timer: delayd.logs may not import "
        "delayd.wheel",
        "delayd.sender.targets imports delayd: delayd.sender may not import delayd",
        "delayd.teleport: delayd.teleport has no row in the layer table",
        "delayd.top.model imports delayd.teleport.beam: delayd.teleport has no row in the "
        "layer table",
        "storage.segment imports delayd.errors: storage may not import delayd.errors",
    ]


def test_a_package_without_a_row_is_found(tmp_path):
    (tmp_path / "delayd" / "teleport").mkdir(parents=True)
    (tmp_path / "delayd" / "teleport" / "__init__.py").write_text("")
    (tmp_path / "delayd" / "version.py").write_text("")
    (tmp_path / "delayd" / "__init__.py").write_text("")
    units = units_in_tree(tmp_path)
    assert units == {"storage", "delayd", "delayd.teleport", "delayd.version"}
    assert sorted(units - RULES.keys()) == ["delayd.teleport"]


# ------------------------------------------------------------ what a layer must not use


def users_of(imports: Mapping[str, Iterable[str]], top: str) -> set[str]:
    """The modules that import ``top`` or any module under it."""
    return {
        module for module, names in imports.items() if any(n.split(".")[0] == top for n in names)
    }


def test_storage_never_imports_delayd():
    imports = source_imports("storage")
    assert len(imports) >= 8  # the scan really saw the package
    assert users_of(imports, "delayd") == set()


def test_storage_does_not_depend_on_trio_except_the_flusher():
    assert users_of(source_imports("storage"), "trio") == {"storage.flusher"}


def test_the_protocol_is_sans_io():
    imports = source_imports("delayd/protocol")
    assert imports  # the scan really saw the package
    assert users_of(imports, "trio") | users_of(imports, "socket") == set()


# The audit's executor side, which Spark's Python workers run: they have pyarrow and
# delayd's own code, but neither trio nor pyspark.
AUDIT_EXECUTOR = (
    "delayd.audit.read",
    "delayd.audit.judge",
    "delayd.audit.schemas",
    "delayd.audit.kinds",
)


def audit_executor_imports() -> dict[str, set[str]]:
    imports = source_imports("delayd/audit")
    return {
        module: names
        for module, names in imports.items()
        if any(module == name or module.startswith(f"{name}.") for name in AUDIT_EXECUTOR)
    }


def test_the_audit_executor_side_imports_no_trio_nor_pyspark():
    imports = audit_executor_imports()
    assert len(imports) >= 10  # the scan really found the readers and the judges
    assert users_of(imports, "trio") | users_of(imports, "pyspark") == set()


def test_importing_the_audit_executor_side_loads_no_trio_nor_pyspark():
    """Also not through what they import (the package roots run first)."""
    script = (
        f"import sys, {', '.join(sorted(audit_executor_imports()))}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('trio', 'pyspark')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_relative_imports_are_read_as_absolute(tmp_path):
    package = tmp_path / "delayd" / "client"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from .producer import Producer\n")
    (package / "producer.py").write_text(
        "from . import _ids\nfrom ..server import app\nfrom delayd import __version__, errors\n"
    )
    assert imported_names(package / "__init__.py", tmp_path) == {"delayd.client.producer"}
    assert imported_names(package / "producer.py", tmp_path) == {
        "delayd.client._ids",
        "delayd.server",
        "delayd",
        "delayd.errors",
    }
