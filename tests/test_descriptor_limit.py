"""The servers raise their soft descriptor limit to the hard one at start
(storage.descriptor_limit): a distribution's default of 1,024 would run out with
enough bucket files and connections."""

import resource
import subprocess
import sys

from tests.intake_support import ServeProcess

HARD = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
WANTED = 1 << 20 if HARD == resource.RLIM_INFINITY else min(HARD, 1 << 20)

PROBE = """
import resource, sys
from storage.descriptor_limit import raise_descriptor_limit
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), hard))
print(raise_descriptor_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def probe(soft: int) -> tuple[int, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(soft)], capture_output=True, text=True, check=True
    )
    returned, now = out.stdout.split()
    return int(returned), int(now)


def soft_limit_of(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as limits:
        line = next(line for line in limits if line.startswith("Max open files"))
    return int(line.split()[3])


def test_the_soft_limit_is_raised_to_the_hard_one():
    assert probe(256) == (WANTED, WANTED)


def test_a_limit_already_at_the_top_is_left_alone():
    assert probe(WANTED) == (WANTED, WANTED)


def test_delayd_serve_started_with_a_low_limit_raises_it(tmp_path, procs):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    server = procs.add(ServeProcess(tmp_path / "data"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # inherited by the child
    try:
        server.start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert server.proc is not None
    assert soft_limit_of(server.proc.pid) == WANTED
    assert server.stop() == 0
