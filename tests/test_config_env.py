"""The effective configuration of `delayd serve`: DELAYD_* environment overrides,
--print-config, [log] taking effect, and every key documented in
docs/configuration.md."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from delayd.server.config import (
    BrokerGroupConfig,
    ConfigError,
    ServeConfig,
    config_from_mapping,
    table_keys,
)
from delayd.server.config_env import environment_overrides, load_effective_config
from delayd.server.config_print import config_to_toml
from storage.flusher import FlushMode
from tests.intake_support import ServeProcess
from tests.process_support import DELAYD, ROOT, child_env

DOCS = ROOT / "docs" / "configuration.md"


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_environment_overrides_are_typed_and_beat_the_file(tmp_path):
    path = write(tmp_path / "d.toml", "[intake]\nmax_delay_ms = 5000\nmax_body_bytes = 77\n")
    environ = {
        "DELAYD_INTAKE_MAX_DELAY_MS": "1_000",
        "DELAYD_MESSAGE_LOG_FLUSH": "async",  # the table name has an underscore
        "DELAYD_SERVER_LISTEN": "0.0.0.0:1234",
        "DELAYD_SERVER_TOKEN": "12345",  # a string key keeps digits as text
        "DELAYD_BROKER_SUBJECT_QUEUES": "{ orders = 8 }",
        "DELAYD_LOG_FORMAT": "json",
        "DELAYD_ADDRESS": "not ours",  # names no table: left alone
        "PATH": "/usr/bin",
    }
    config = load_effective_config(path, environ)
    assert config.limits.max_delay_ms == 1000
    assert config.limits.max_body_bytes == 77  # from the file
    assert config.flush.mode is FlushMode.ASYNC
    assert config.listen == ("0.0.0.0", 1234) and config.token == "12345"
    assert config.broker.subject_queues == {"orders": 8}
    assert config.log_format == "json"
    assert load_effective_config(None, {}) == ServeConfig()


@pytest.mark.parametrize(
    ("variable", "value", "words"),
    [
        ("DELAYD_INTAKE_MAX_DELAY_MS", "abc", ["positive integer", "'abc'"]),
        ("DELAYD_INTAKE_MAX_DELAY_MS", "-5", ["positive integer"]),
        ("DELAYD_SERVER_LISTEN", "nowhere", ["HOST:PORT"]),
        ("DELAYD_MESSAGE_LOG_FLUSH", "never", ["sync, async"]),
        ("DELAYD_LOG_LEVEL", "loud", ["debug"]),
        ("DELAYD_BROKER_QUEUES_PER_SUBJECT", "many", ["must be an integer"]),
    ],
)
def test_an_invalid_override_names_the_variable_and_the_key(variable, value, words):
    with pytest.raises(ConfigError) as caught:
        load_effective_config(None, {variable: value})
    message = str(caught.value)
    key = variable.removeprefix("DELAYD_").lower()
    table = next(t for t in sorted(table_keys(), key=len, reverse=True) if key.startswith(t))
    assert f"environment variable {variable} ({table}.{key[len(table) + 1 :]})" in message
    for word in words:
        assert word in message


def test_an_unknown_key_of_a_known_table_is_refused():
    expected = r"DELAYD_INTAKE_MAX_DELAY: unknown key intake\.max_delay"
    with pytest.raises(ConfigError, match=expected):
        environment_overrides({"DELAYD_INTAKE_MAX_DELAY": "5"})


def test_print_config_reads_back_as_the_same_configuration():
    config = ServeConfig(
        listen=("::1", 20801),
        metrics_listen=None,
        token="s3cret",
        segment_scale_minutes=5,
        broker_groups=(
            BrokerGroupConfig("east", ("10.0.0.5:20811", "10.0.0.6:20811"), weight=2),
            BrokerGroupConfig("local", embedded=True),
        ),
        log_level="debug",
    )
    text = config_to_toml(config)
    assert "s3cret" not in text and "# token: set" in text
    document = tomllib.loads(text)
    assert document["server"]["listen"] == "[::1]:20801"
    assert document["server"]["metrics_listen"] == "off"
    assert document["wheel"]["load_ahead_ms"] == 2 * 5 * 60_000  # the effective value
    again = config_from_mapping(document)
    assert again == dataclasses.replace(config, token=None, load_ahead_ms=600_000)


def test_every_key_is_documented_with_a_default():
    """Each table's section of docs/configuration.md has a row for each of its keys
    (``| `key` | default | meaning |``); [broker] names its keys in a list."""
    text = DOCS.read_text()
    sections = dict(re.findall(r"^## `\[(\w+)\]`[^\n]*\n(.*?)(?=^## |\Z)", text, re.S | re.M))
    for table, keys in table_keys().items():
        assert table in sections, f"no section for [{table}]"
        for key in keys:
            if table == "broker":
                assert f"`{key}`" in sections[table], f"broker.{key} undocumented"
            else:
                row = re.search(rf"^\| `{key}` \| ([^|]+) \|", sections[table], re.M)
                assert row and row.group(1).strip(), f"{table}.{key} has no row with a default"


def run_serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*DELAYD, "serve", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**child_env(), **(env or {})},
        timeout=30,
        check=False,
    )


def test_print_config_applies_file_then_environment_then_flags(tmp_path):
    path = write(
        tmp_path / "d.toml",
        '[server]\nlisten = "127.0.0.1:1"\ntoken = "hush"\n[intake]\nmax_body_bytes = 11\n'
        "max_pending_acks = 12\n",
    )
    env = {"DELAYD_SERVER_LISTEN": "127.0.0.1:2", "DELAYD_INTAKE_MAX_PENDING_ACKS": "13"}
    done = run_serve("--config", path, "--listen", "127.0.0.1:3", "--print-config", env=env)
    assert done.returncode == 0, done.stderr
    document = tomllib.loads(done.stdout)
    assert document["server"]["listen"] == "127.0.0.1:3"  # the flag
    assert document["intake"]["max_pending_acks"] == 13  # the environment
    assert document["intake"]["max_body_bytes"] == 11  # the file
    assert document["server"]["metrics_listen"] == "127.0.0.1:20880"  # the default
    assert "hush" not in done.stdout + done.stderr
    assert not (tmp_path / "data").exists()


def test_an_invalid_override_is_refused_at_start(tmp_path):
    server = ServeProcess(tmp_path / "data", env={"DELAYD_REPLAY_BATCH_RECORDS": "0"})
    code, log = server.run_to_exit()
    assert code == 2
    assert "environment variable DELAYD_REPLAY_BATCH_RECORDS (replay.batch_records)" in log
    assert not (tmp_path / "data").exists()  # refused before the data directory is touched


def test_log_keys_of_the_file_take_effect(tmp_path, procs):
    """[log] is read after logging was set up from the flags: the file's format and
    level replace them (json; warning hides the info lines a start writes)."""
    path = write(tmp_path / "d.toml", '[log]\nformat = "json"\nlevel = "warning"\n')
    server = procs.start(ServeProcess(tmp_path / "data", "--config", path))
    assert server.stop() == 0
    assert server.log_path.read_text() == ""  # nothing at warning or above
    path = write(tmp_path / "d.toml", '[log]\nformat = "json"\n')
    server = procs.start(ServeProcess(tmp_path / "data", "--config", path))
    assert server.stop() == 0
    records = [json.loads(line) for line in server.log_path.read_text().splitlines()]
    assert any(r["msg"] == "delayd serve stopped" for r in records)
    # A flag still beats the file.
    done = run_serve("--config", path, "--log-format", "kv", "--print-config")
    assert tomllib.loads(done.stdout)["log"]["format"] == "kv"
