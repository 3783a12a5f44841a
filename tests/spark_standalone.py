"""A Spark standalone cluster on this machine, started from pyspark's own scripts — a
master and workers (``bin/spark-class org.apache.spark.deploy.master.Master`` and
``…worker.Worker spark://…``) on the loopback address — for the cluster audit's test
(tests/test_audit_cluster.py) and benchmark (tools/bench_cluster_audit.py); and what an
application cost on its executors.

Each daemon starts a session of its own: its executors and their Python workers stay in
it (pyspark's daemon moves to a process group of its own, never to another session), so
``close()`` finds and kills every process of those sessions, and ``executor_cpu()``
adds up their CPU time — the JVM's and Python's, which Spark's
own "Executor CPU Time" leaves out (it is the JVM task thread's: a Python data source
decodes in Python workers).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

import pyspark

from tests.process_support import child_env, free_port

SPARK_HOME = os.path.dirname(pyspark.__file__)
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
_CLK_TCK = os.sysconf("SC_CLK_TCK")
# Warnings and errors only, on stderr (Spark's own default logs every task at INFO).
QUIET_LOG4J = """rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n
"""


def spark_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the daemons and of spark-submit: this checkout first on
    PYTHONPATH, this interpreter for drivers and Python workers, the loopback address."""
    env = child_env()
    env.update(
        SPARK_HOME=SPARK_HOME,
        PYSPARK_PYTHON=sys.executable,
        PYSPARK_DRIVER_PYTHON=sys.executable,
        SPARK_LOCAL_IP="127.0.0.1",
        **(extra or {}),
    )
    return env


class StandaloneCluster:
    """A master and ``workers`` workers of ``cores`` cores and ``memory`` each, their
    logs, work directories and Spark configuration (``defaults`` for spark-submit)
    under ``root`` (standalone_cluster runs one); ``daemon_java_opts`` for the master's
    and workers' JVMs."""

    def __init__(
        self,
        root: Path,
        *,
        workers: int = 2,
        cores: int = 1,
        memory: str = "1g",
        defaults: dict[str, str] | None = None,
        daemon_java_opts: str = "",
    ) -> None:
        self.root = root
        self.workers = workers
        self.cores = cores
        self.memory = memory
        self.defaults = defaults or {}
        # Spark's configuration directory: spark-submit takes ``defaults`` from its
        # spark-defaults.conf, so a command run as an operator types it gets them too.
        self.conf_dir = root / "conf"
        self.env = spark_env({"SPARK_CONF_DIR": str(self.conf_dir)})
        if daemon_java_opts:  # the master's and workers' JVMs (spark-class reads it)
            self.env["SPARK_DAEMON_JAVA_OPTS"] = daemon_java_opts
        self.port = free_port()
        self.ui_port = free_port()
        self.daemons: list[subprocess.Popen[bytes]] = []
        self.commands: list[list[str]] = []  # each daemon's, as run

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def start(self) -> Self:
        """The master, then the workers; returns once every worker has registered.
        Raises RuntimeError with the daemons' logs if that takes over a minute."""
        self.conf_dir.mkdir(parents=True, exist_ok=True)
        lines = [f"{key} {value}\n" for key, value in self.defaults.items()]
        (self.conf_dir / "spark-defaults.conf").write_text("".join(lines))
        (self.conf_dir / "log4j2.properties").write_text(QUIET_LOG4J)
        master = [
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--webui-port",
            str(self.ui_port),
        ]
        self._spawn("master", "org.apache.spark.deploy.master.Master", *master)
        for i in range(self.workers):
            worker = [self.url, "--host", "127.0.0.1", "--cores", str(self.cores)]
            worker += ["--memory", self.memory, "--webui-port", str(free_port())]
            worker += ["--work-dir", str(self.root / f"work-{i}")]
            self._spawn(f"worker-{i}", "org.apache.spark.deploy.worker.Worker", *worker)
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.alive_workers() < self.workers:
            if time.monotonic() > deadline or any(d.poll() is not None for d in self.daemons):
                logs = "\n".join(p.read_text() for p in sorted(self.root.glob("*.log")))
                raise RuntimeError(f"the standalone cluster did not come up:\n{logs[-4000:]}")
            time.sleep(0.2)
        return self

    def _spawn(self, name: str, main_class: str, *args: str) -> None:
        spark_class = os.path.join(SPARK_HOME, "bin", "spark-class")
        self.commands.append([spark_class, main_class, *args])
        with open(self.root / f"{name}.log", "wb") as log:
            self.daemons.append(
                subprocess.Popen(
                    [spark_class, main_class, *args],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    start_new_session=True,
                )
            )

    def state(self) -> dict:
        """The master's JSON status (its web UI's /json)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=2) as r:
            return json.load(r)

    def alive_workers(self) -> int:
        try:
            return int(self.state()["aliveworkers"])
        except OSError:
            return 0  # the master's UI is not up yet

    def submit(
        self, app: str, *args: str, conf: dict[str, str] | None = None, timeout_s: float = 300
    ) -> subprocess.CompletedProcess[str]:
        """``spark-submit --master <this cluster> app args`` to its end."""
        command = [os.path.join(SPARK_HOME, "bin", "spark-submit"), "--master", self.url]
        for key, value in (conf or {}).items():
            command += ["--conf", f"{key}={value}"]
        return subprocess.run(
            [*command, app, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    def processes(self) -> list[int]:
        """Every live process of the daemons' sessions (daemons, executors, Python
        workers)."""
        sessions = {d.pid for d in self.daemons}
        return [pid for pid, session, _ in _stats() if session in sessions]

    def executor_cpu(self) -> CpuSampler:
        """A sampler of the CPU time of what runs under the workers: executors and
        their Python workers (not the worker daemons themselves)."""
        return CpuSampler({d.pid for d in self.daemons[1:]})

    def close(self) -> None:
        """SIGTERM to every process of the daemons' sessions; SIGKILL to what is left
        after STOP_TIMEOUT_S."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.processes():
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                    os.kill(pid, sig)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while self.processes() and time.monotonic() < deadline:
                for daemon in self.daemons:
                    daemon.poll()  # reap the daemons: a zombie is still listed
                time.sleep(0.1)
        for daemon in self.daemons:
            daemon.wait()


@contextlib.contextmanager
def standalone_cluster(root: Path, **sizes: Any) -> Iterator[StandaloneCluster]:
    """A StandaloneCluster (``sizes``: its keyword arguments), started; every process
    of it killed at the end, also when it fails to start."""
    cluster = StandaloneCluster(root, **sizes)
    try:
        yield cluster.start()
    finally:
        cluster.close()


class CpuSampler:
    """CPU seconds (user + system) used by the processes of ``sessions``, their leaders
    left out, while it runs (``with``): sampled every SAMPLE_S, each process counted
    at the last sample that saw it. A process ending between two samples loses at most
    SAMPLE_S of CPU; an application's executors live as long as it does."""

    SAMPLE_S = 0.2

    def __init__(self, sessions: set[int]) -> None:
        self.sessions = sessions
        self.ticks: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    @property
    def seconds(self) -> float:
        return sum(self.ticks.values()) / _CLK_TCK

    def _run(self) -> None:
        while not self._stop.wait(self.SAMPLE_S):
            self._sample()

    def _sample(self) -> None:
        for pid, session, ticks in _stats():
            if session in self.sessions and pid not in self.sessions:
                self.ticks[pid] = ticks


def _stats() -> list[tuple[int, int, int]]:
    """(pid, session id, utime + stime in clock ticks) of every live process (not the
    zombies: they wait to be reaped, their CPU already counted)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # it ended
        # After "pid (comm) ": state, ppid, pgrp, session, …, utime (12th), stime (13th).
        fields = text[text.rindex(")") + 2 :].split()
        if fields[0] != "Z":
            found.append((int(entry), int(fields[3]), int(fields[11]) + int(fields[12])))
    return found


def event_log_conf(directory: Path) -> dict[str, str]:
    """spark-submit settings that write the application's event log, uncompressed, into
    ``directory`` (created)."""
    directory.mkdir(parents=True, exist_ok=True)
    return {
        "spark.eventLog.enabled": "true",
        "spark.eventLog.dir": directory.as_uri(),
        "spark.eventLog.compress": "false",
    }


def task_ends(directory: Path) -> list[dict]:
    """The SparkListenerTaskEnd events of every event log in ``directory`` (Spark 4
    writes each application's as a directory of ``events_N_…`` files)."""
    ends = []
    for path in sorted(directory.rglob("events_*")):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event["Event"] == "SparkListenerTaskEnd":
                ends.append(event)
    return ends
