"""Structured logs (delayd.structured_logs): key=value and JSON lines, levels, fields,
tracebacks on one line; and `delayd serve` / `delayd broker` wired to them without
touching their ready lines on stdout."""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess

import pytest

from delayd.structured_logs import configure_logging, fields
from tests.broker_support import BrokerProcess
from tests.intake_support import ServeProcess, write_config
from tests.process_support import DELAYD, ROOT, child_env

KV_PAIR = re.compile(r'(\S+?)=("(?:[^"\\]|\\.)*"|\S*)')


def parse_kv(line: str) -> dict[str, str]:
    """A logfmt line back into its pairs (quoted values unescaped), checking that the
    pairs cover the whole line."""
    pairs = KV_PAIR.findall(line)
    assert " ".join(f"{k}={v}" for k, v in pairs) == line
    return {key: json.loads(value) if value.startswith('"') else value for key, value in pairs}


@pytest.fixture
def root_logging():
    """Leave the root logger as the test found it (pytest's capture handlers too)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def test_kv_lines_carry_message_fields_and_fixed_keys(root_logging):
    out = io.StringIO()
    configure_logging("kv", "info", stream=out)
    log = logging.getLogger("delayd.test")
    log.info(
        "replayed %d records",
        5,
        extra=fields(bucket="202611221000", note='two "words"', cut=0, ok=True, msg="mine"),
    )
    (line,) = out.getvalue().splitlines()
    pairs = parse_kv(line)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", pairs.pop("ts"))
    assert pairs == {
        "level": "info",
        "logger": "delayd.test",
        "msg": "replayed 5 records",
        "bucket": "202611221000",
        "note": 'two "words"',
        "cut": "0",
        "ok": "true",
        "field.msg": "mine",  # a field never hides a fixed key
    }
    assert line.split(" ")[1:4] == ["level=info", "logger=delayd.test", 'msg="replayed']


def test_json_lines_keep_types_and_a_traceback_stays_on_one_line(root_logging):
    out = io.StringIO()
    configure_logging("json", "debug", stream=out)
    log = logging.getLogger("delayd.test")
    log.debug("cut a torn tail", extra=fields(bytes=120, at=4096, path="/d/x y"))
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        log.exception("failed")
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["level"] == "debug" and first["msg"] == "cut a torn tail"
    assert (first["bytes"], first["at"], first["path"]) == (120, 4096, "/d/x y")
    assert second["level"] == "error" and second["msg"] == "failed"
    assert "Traceback" in second["exc"] and "ValueError: bad\nthing" in second["exc"]


def test_kv_escapes_newlines_so_a_record_is_one_line(root_logging):
    out = io.StringIO()
    configure_logging("kv", "info", stream=out)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("delayd.test").exception("first line\nsecond line")
    (line,) = out.getvalue().splitlines()
    pairs = parse_kv(line)
    assert pairs["msg"] == "first line\nsecond line"
    assert pairs["exc"].startswith("Traceback") and pairs["exc"].endswith("RuntimeError: boom")


def test_level_filters_and_a_second_call_replaces_the_first(root_logging):
    first, second = io.StringIO(), io.StringIO()
    configure_logging("kv", "info", stream=first)
    configure_logging("json", "warning", stream=second)
    log = logging.getLogger("delayd.test")
    log.info("quiet")
    log.warning("loud %s", "now")
    assert first.getvalue() == ""
    (line,) = second.getvalue().splitlines()
    assert json.loads(line)["msg"] == "loud now"


@pytest.mark.parametrize(("log_format", "level"), [("text", "info"), ("kv", "verbose")])
def test_unknown_format_or_level_is_refused(root_logging, log_format, level):
    with pytest.raises(ValueError, match="must be one of"):
        configure_logging(log_format, level)


def test_serve_logs_json_and_keeps_its_ready_lines_on_stdout(tmp_path, procs):
    server = procs.add(
        ServeProcess(tmp_path / "data", "--metrics-listen", "127.0.0.1:0", "--log-format", "json")
    )
    server.start()  # parses "delayd serve listening on H:P" from stdout
    assert server.metrics_address is not None and server.broker_address is not None
    assert server.stop() == 0
    lines = server.log_path.read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every stderr line is a JSON record
    assert any(r["msg"] == "delayd serve stopped" and r["level"] == "info" for r in records)
    assert {"ts", "level", "logger", "msg"} <= set(records[0])


def test_serve_reports_a_bad_configuration_as_a_log_record(tmp_path):
    config = write_config(tmp_path / "c.toml", "[intake]\nmax_dealy_ms = 5\n")
    args = [*DELAYD, "serve", "--data", str(tmp_path / "data"), "--config", str(config)]
    done = subprocess.run(
        [*args, "--log-format", "kv", "--log-level", "warning"],
        cwd=ROOT,
        capture_output=True,
        env=child_env(),
        timeout=30,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.decode().splitlines()
    pairs = parse_kv(line)
    assert pairs["level"] == "error" and pairs["logger"] == "delayd.serve"
    assert "unknown key intake.max_dealy_ms" in pairs["msg"]


def test_broker_logs_kv_and_its_metrics_line_is_still_found(tmp_path, procs):
    broker = procs.add(BrokerProcess(tmp_path / "data", "--log-format", "kv"))
    broker.start()  # ready line from stdout, metrics address from the log
    assert broker.metrics_address is not None
    assert broker.stop() == 0
    lines = broker.log_path.read_text().splitlines()
    records = [parse_kv(line) for line in lines]  # every stderr line is a logfmt record
    assert any(r["msg"] == "delayd broker stopped" for r in records)
