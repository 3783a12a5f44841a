"""The lean install: the server and the clients run without the ``audit`` extra (Spark
and Arrow, ~700 MB), and the wheel ships what a user of the package needs — the
license, the type marker, and the Spark application the audit docs tell users to
spark-submit."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.intake_support import METRICS, READY, START_TIMEOUT_S
from tests.process_support import DELAYD, ROOT, child_env

HEAVY = ("pyspark", "pyarrow")
# Makes pyspark and pyarrow unimportable; at exit reports which of their modules were
# asked for and which got loaded all the same. Then runs what follows it.
BLOCK = f"""
import atexit, importlib.abc, runpy, sys
HEAVY = {HEAVY!r}
asked = []
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HEAVY:
            asked.append(name)
            raise ModuleNotFoundError(f"blocked: {{name}}", name=name)
sys.meta_path.insert(0, Block())
def report():
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)
    sys.stderr.write(f"\\nheavy modules asked for: {{asked}}; loaded: {{loaded}}\\n")
atexit.register(report)
"""
NONE_ASKED = "heavy modules asked for: []; loaded: []"


AUDIT_JOB = ROOT / "delayd" / "cli" / "spark_submit" / "audit_job.py"


def blocked(*args: str) -> list[str]:
    """The delayd command with ``args``, Spark and Arrow blocked."""
    run = "from delayd.cli.main import main\nsys.exit(main(sys.argv[1:]))\n"
    return [sys.executable, "-c", BLOCK + run, *args]


def blocked_file(path: Path, *args: str) -> list[str]:
    """``python path args``, Spark and Arrow blocked."""
    run = f"sys.argv[0] = {str(path)!r}\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"
    return [sys.executable, "-c", BLOCK + run, *args]


def test_blocker_sees_an_import_of_spark():
    """The check below would catch an import: the audit's spark path asks for pyspark."""
    done = subprocess.run(
        [sys.executable, "-c", BLOCK + "import pyspark\n"],
        capture_output=True,
        text=True,
        env=child_env(),
    )
    assert "heavy modules asked for: ['pyspark']; loaded: []" in done.stderr


@pytest.mark.slow
def test_serve_send_and_consume_never_import_spark_or_arrow(tmp_path):
    """A real ``delayd serve`` starts, takes a message, delivers it, answers /metrics and
    stops; ``delayd send`` and ``delayd consume`` run against it: none of them so much as
    asks for pyspark or pyarrow."""
    serve = subprocess.Popen(
        blocked(
            "serve",
            "--data",
            str(tmp_path / "data"),
            "--listen",
            "127.0.0.1:0",
            "--broker-listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        lines = []
        while (ready := READY.search("".join(lines))) is None:
            line = serve.stdout.readline()
            assert line, f"serve exited: {serve.wait(10)} {serve.stderr.read()}"
            lines.append(line)
        intake = "{}:{}".format(*ready.groups())
        broker = re.search(r"broker listening on (\S+:\d+)", "".join(lines)).group(1)
        metrics = "http://{}:{}/metrics".format(*METRICS.search("".join(lines)).groups())
        consume = ["--subject", "orders", "--group", "g", "--count", "1", "--timeout", "15"]
        for args, prints in (
            (["send", "--server", intake, "--subject", "orders", "--delay", "0s", "hi"], ""),
            (["consume", "--broker", broker, *consume], "hi"),
            (["top", "--once", "--interval", "0.2", metrics], "throughput"),
        ):
            done = subprocess.run(
                blocked(*args), capture_output=True, text=True, env=child_env(), timeout=30
            )
            assert done.returncode == 0, done.stderr
            assert prints in done.stdout and NONE_ASKED in done.stderr
        serve.terminate()
        _, stderr = serve.communicate(timeout=START_TIMEOUT_S)
        assert serve.returncode == 0, stderr
        assert NONE_ASKED in stderr
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait(10)


def test_the_audit_says_what_to_install_without_the_extra(tmp_path):
    """``delayd audit`` and the spark-submit application exit 2 naming the extra."""
    (tmp_path / "data" / "delay").mkdir(parents=True)
    job = subprocess.run(
        [*DELAYD, "audit", "--job-path"], capture_output=True, text=True, env=child_env()
    )
    submit = job.stdout.strip()
    assert job.returncode == 0 and Path(submit) == AUDIT_JOB
    arguments = ["--data", str(tmp_path / "data"), "--out", str(tmp_path / "out")]
    # `delayd audit`, and the file spark-submit runs, run by a plain interpreter
    for args in (blocked("audit", *arguments), blocked_file(Path(submit), *arguments)):
        done = subprocess.run(args, capture_output=True, text=True, env=child_env())
        assert done.returncode == 2, done.stderr
        assert "pip install 'delayd[audit]'" in done.stderr


def test_the_audit_application_runs_from_the_checkout_and_the_package():
    """``tools/audit_job.py`` (the checkout's entry) and the installed file take the
    audit's arguments."""
    for path in (ROOT / "tools" / "audit_job.py", AUDIT_JOB):
        done = subprocess.run(
            [sys.executable, str(path), "--help"], capture_output=True, text=True, env=child_env()
        )
        assert done.returncode == 0, done.stderr
        assert "--data" in done.stdout and "--master" in done.stdout


def test_the_wheel_ships_the_license_the_type_marker_and_the_audit_application(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    for package in ("delayd", "storage"):
        shutil.copytree(
            ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(tmp_path / "dist"),
            str(source),
        ],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "dist").glob("delayd-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"delayd/py.typed", "storage/py.typed", "delayd/cli/spark_submit/audit_job.py"} <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    assert "License-Expression: Apache-2.0" in text
    # Spark and Arrow only with the extra.
    requires = re.findall(r"^Requires-Dist: (.*)$", text, re.M)
    heavy = [r for r in requires if r.startswith(HEAVY)]
    assert heavy and all('extra == "audit"' in r for r in heavy), heavy
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
