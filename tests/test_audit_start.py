"""``delayd audit`` when Spark cannot start: exit status 2 (the audit could not run, as
opposed to 1, discrepancies found), at once, with what to install or set."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from delayd.logs import layout
from tests.process_support import DELAYD, ROOT, child_env

pytest.importorskip("pyspark")


def audit(tmp_path, **environ: str) -> tuple[subprocess.CompletedProcess[str], float]:
    data = tmp_path / "data"
    os.makedirs(layout.schedule_log_dir(str(data)), exist_ok=True)  # an empty data directory
    env = {**child_env(), **environ}
    started = time.monotonic()
    done = subprocess.run(
        [*DELAYD, "audit", "--data", str(data), "--out", str(tmp_path / "out")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return done, time.monotonic() - started


def test_a_java_home_without_java_exits_2_saying_what_to_set(tmp_path):
    done, took_s = audit(tmp_path, JAVA_HOME=str(tmp_path / "no-such-jdk"))
    assert done.returncode == 2, done.stderr
    assert f"JAVA_HOME is '{tmp_path / 'no-such-jdk'}', which has no bin/java" in done.stderr
    assert "install Java 17" in done.stderr and "Traceback" not in done.stderr
    assert took_s < 20  # no JVM was started to find out


def test_no_java_on_the_path_exits_2_saying_what_to_install(tmp_path):
    env = child_env()
    env.pop("JAVA_HOME", None)
    done, _ = audit(tmp_path, **{**env, "PATH": str(tmp_path / "empty-bin")})
    assert done.returncode == 2, done.stderr
    assert "no java on the PATH" in done.stderr and "openjdk-17" in done.stderr


def test_a_java_that_does_not_start_exits_2(tmp_path):
    java = tmp_path / "broken-jdk" / "bin" / "java"
    java.parent.mkdir(parents=True)
    java.write_text("#!/bin/sh\necho 'this java is broken' >&2\nexit 1\n")
    java.chmod(0o755)
    done, _ = audit(tmp_path, JAVA_HOME=str(java.parent.parent))
    assert done.returncode == 2, done.stderr
    assert "Spark did not start" in done.stderr and "JAVA_HOME" in done.stderr
