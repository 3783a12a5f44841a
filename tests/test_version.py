"""The version lives in delayd/version.py only: the package, the packaging metadata,
`delayd --version` and the names the clients and the sender give in HELLO all read it."""

from __future__ import annotations

import pathlib
import tomllib

import pytest

import delayd
from delayd import version
from delayd.cli import main as cli
from delayd.client import async_producer, blocking_consumer, blocking_producer
from delayd.sender import targets

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_package_reexports_the_leaf():
    assert delayd.__version__ is version.__version__


def test_pyproject_reads_the_version_from_the_leaf():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"]
    assert "version" in project["project"]["dynamic"]
    dynamic = project["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "delayd.version.__version__"}


def test_delayd_version_prints_it(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"delayd {version.__version__}"


def test_hello_names_carry_it():
    for client_name in (
        async_producer.CLIENT_NAME,
        blocking_consumer.CLIENT_NAME,
        blocking_producer.CLIENT_NAME,
        targets.CLIENT_NAME,
    ):
        assert client_name.endswith(f"/{version.__version__}")
