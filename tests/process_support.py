"""`delayd` children of the tests: the command, where it runs and with what environment,
and what ``delayd serve`` and ``delayd broker`` children share: the end of their life
and their /metrics."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Self

ROOT = Path(__file__).resolve().parent.parent
DELAYD = [sys.executable, "-m", "delayd"]


def free_port() -> int:
    """A loopback port that was free a moment ago (for a child that must listen, or come
    back, on an address known before it starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    """This process's environment with the checkout first on PYTHONPATH, so that a
    child runs the code under test (a worktree's, not an installed copy)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_bench_tool(*args: str, timeout_s: float = 180) -> list[dict]:
    """Run tools/``args`` (a benchmark); the JSON figures it printed, each checked for the
    keys every benchmark prints (bench, metric, value, unit)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / args[0]), *args[1:]],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=child_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert rows and all({"bench", "metric", "value", "unit"} <= set(row) for row in rows)
    return rows


class ChildProcess:
    """A server child: ``stop()`` is SIGTERM and returns the exit code (a graceful
    shutdown gives 0); ``kill()`` is kill -9; ``close()`` (the ``procs`` fixture calls
    it) makes sure the child does not outlive its test; as a context manager it is started
    and closed. Subclasses start it and set ``proc``; ``log_path`` holds its stderr."""

    proc: subprocess.Popen[bytes] | None
    log_path: Path
    metrics_address: tuple[str, int] | None

    def start(self) -> Self:
        raise NotImplementedError

    def __enter__(self) -> Self:
        """Started, for a fixture wider than a test (where ``procs`` cannot hold it);
        closed on leaving, and at once if it fails to start."""
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def metrics_page(self) -> str:
        """Its /metrics as exposed now, ``# HELP`` and ``# TYPE`` lines included."""
        assert self.metrics_address is not None, "started without a metrics listener"
        url = "http://{}:{}/metrics".format(*self.metrics_address)
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read().decode()

    def metrics(self) -> dict[str, float]:
        """Every sample its /metrics shows now, by ``name{labels}`` as exposed."""
        lines = self.metrics_page().splitlines()
        samples = (line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))
        return {name: float(value) for name, value in samples}

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])
