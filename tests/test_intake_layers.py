"""The intake's layers point down only (DESIGN.md, "Layers"): the formats know nothing of
the server or of trio, the receiver does no I/O, the replayer knows no protocol."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def imports(relative: str) -> set[str]:
    """Every module imported (absolutely) by the file or package at ``relative``."""
    path = ROOT / relative
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
    assert files, relative
    names: set[str] = set()
    for file in files:
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
    return names


def offenders(names: set[str], *forbidden: str) -> list[str]:
    return sorted(n for n in names if any(n == f or n.startswith(f + ".") for f in forbidden))


def test_formats_sit_on_storage_only():
    names = imports("delayd/logs")
    assert "storage.record_file" in names  # the scan saw the package
    higher = ("delayd.protocol", "delayd.server", "delayd.replay")
    assert offenders(names, "trio", "socket", "delayd.broker", "delayd.client", *higher) == []


def test_receiver_is_pure():
    names = imports("delayd/server/receiver.py")
    assert offenders(names, "trio", "anyio", "socket", "time", "storage", "delayd.server") == []


def test_replay_knows_no_protocol_and_no_server():
    names = imports("delayd/replay")
    assert offenders(names, "delayd.protocol", "delayd.server", "socket") == []
