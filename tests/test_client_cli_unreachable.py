"""The client commands against an address where nothing listens: they fail at once
(issue 22: it took 10 s, the whole --timeout of retries) and say what to check."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.process_support import DELAYD, ROOT, child_env, free_port

COMMANDS = {
    "send": ["send", "--subject", "s", "--delay", "1s", "hello"],
    "cancel": ["cancel", "some-id"],
    "reschedule": ["reschedule", "--delay", "1s", "some-id"],
    "consume": ["consume", "--subject", "s", "--group", "g"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_nobody_listening_fails_at_once_naming_what_to_check(command: str) -> None:
    addr = f"127.0.0.1:{free_port()}"
    flag = "--broker" if command == "consume" else "--server"
    argv = [*DELAYD, *COMMANDS[command], flag, addr]
    started = time.monotonic()
    done = subprocess.run(
        argv, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=30
    )
    elapsed = time.monotonic() - started
    assert done.returncode == 1, done.stderr
    assert f"delayd {command}: cannot connect to {addr}: Connection refused" in done.stderr
    assert "Is `delayd serve` (or `delayd broker`) running there" in done.stderr
    assert "is the port right?" in done.stderr
    # The commands' --timeout is 10 s, which a retrying command would spend; a Python
    # start on a loaded machine alone takes up to a second or two.
    assert elapsed < 5.0
