"""The HTTP/JSON API (docs/http.md) against real ``delayd serve`` processes: the
documented curl examples, bad input, the token, consumer groups shared by HTTP
members, the listener off, and the OpenAPI document kept in docs/."""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from delayd.server.http.openapi import openapi_document, render
from tests.delivery_support import broker_stats, poll
from tests.intake_support import ServeProcess
from tests.process_support import ROOT

pytestmark = pytest.mark.slow

DOCS = ROOT / "docs" / "http.md"
OPENAPI = ROOT / "docs" / "openapi.json"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.S | re.M)
SMALL_LIMITS = """
[intake]
max_body_bytes = 4096
max_record_bytes = 16384

[broker]
queues_per_subject = 2
heartbeat_timeout_ms = 60000
"""


def http_serve_process(tmp_path: Path, config: str = "") -> ServeProcess:
    """``delayd serve`` with the HTTP API on a free port (not started)."""
    args = []
    if config:
        path = tmp_path / "serve.toml"
        path.write_text(config)
        args += ["--config", str(path)]
    return ServeProcess(tmp_path / "data", *args, metrics_listen="off", http_listen="127.0.0.1:0")


@pytest.fixture
def http_server(tmp_path, procs):
    return procs.start(http_serve_process(tmp_path, config=SMALL_LIMITS))


def base_url(server: ServeProcess) -> str:
    assert server.http_address is not None, server.stdout
    return "http://{}:{}".format(*server.http_address)


def same_apart_from_times(expected, actual) -> bool:
    """Equal, but for the values of ``*_ms`` keys (times differ between runs)."""
    if isinstance(expected, dict):
        return (
            isinstance(actual, dict)
            and expected.keys() == actual.keys()
            and all(
                (k.endswith("_ms") and (v is None) == (actual[k] is None))
                or same_apart_from_times(v, actual[k])
                for k, v in expected.items()
            )
        )
    if isinstance(expected, list):
        return (
            isinstance(actual, list)
            and len(expected) == len(actual)
            and all(map(same_apart_from_times, expected, actual))
        )
    return expected == actual


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_every_curl_example_of_the_docs_gives_the_output_shown(http_server):
    """The walk of docs/http.md, run with curl in order: schedule, duplicate, status
    pending, batch, reschedule, cancel, long-poll pull until order-42 comes due, commit,
    status delivered, leave, an error."""
    env = {**os.environ, "DELAYD_HTTP": base_url(http_server)}
    blocks = BLOCK.findall(DOCS.read_text())
    # Each curl command is followed by the output it gives.
    examples = [
        (command, shown)
        for (kind, command), (next_kind, shown) in itertools.pairwise(blocks)
        if kind == "sh" and command.startswith("curl") and next_kind == "json"
    ]
    assert len(examples) == sum(command.startswith("curl") for _, command in blocks) >= 12
    for command, shown in examples:
        expected = json.loads(shown)
        deadline = time.monotonic() + 5
        while True:
            done = subprocess.run(
                ["bash", "-c", command], env=env, capture_output=True, text=True, timeout=30
            )
            assert done.returncode == 0, (command, done.stderr)
            actual = json.loads(done.stdout)
            # A status read right after the commit may come before the sender recorded
            # the broker's ack (delivered is written once the ack is back): ask again.
            if same_apart_from_times(expected, actual) or time.monotonic() > deadline:
                break
            if " -X " in command:  # only a GET may be repeated
                break
            time.sleep(0.05)
        assert same_apart_from_times(expected, actual), (command, actual)


def test_the_openapi_document_in_docs_is_the_one_served(http_server):
    served = httpx.get(base_url(http_server) + "/openapi.json").json()
    assert served == json.loads(OPENAPI.read_text())
    assert render(openapi_document()) == OPENAPI.read_text()  # and rendered as written


def post(server: ServeProcess, path: str, body, **kwargs) -> httpx.Response:
    if isinstance(body, (dict, list)):
        kwargs["json"] = body
    else:
        kwargs["content"] = body
    return httpx.post(base_url(server) + path, timeout=30, **kwargs)


def problem_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert problem["status"] == status and problem["detail"] and problem["type"]
    return problem


def test_bad_input_is_answered_with_a_problem_never_a_500(http_server):
    s = http_server
    as_json = {"Content-Type": "application/json"}
    not_json = post(s, "/v1/messages", b"{nope", headers=as_json)
    assert "not valid JSON" in problem_of(not_json, 400)["detail"]
    untyped = post(s, "/v1/messages", b'{"subject": "a"}')  # no Content-Type
    assert "Content-Type: application/json" in problem_of(untyped, 400)["detail"]
    unknown = problem_of(post(s, "/v1/messages", {"subject": "a", "dealy": 5}), 422)
    assert "dealy" in unknown["detail"]
    both = problem_of(post(s, "/v1/messages", {"subject": "a", "at": 1, "delay": 1}), 422)
    assert "both at and delay" in both["detail"]
    at = problem_of(post(s, "/v1/messages", {"subject": "a", "at": "2026-11-22T10:00"}), 422)
    assert "no time zone" in at["detail"]
    b64 = {"subject": "a", "body_base64": "***"}
    assert "not base64" in problem_of(post(s, "/v1/messages", b64), 422)["detail"]
    two_bodies = {"subject": "a", "body": "x", "body_base64": "eA=="}
    problem_of(post(s, "/v1/messages", two_bodies), 422)
    bad_id = problem_of(post(s, "/v1/messages", {"subject": "a", "id": "a\nb"}), 422)
    assert bad_id["code"] == "INVALID_ID"
    empty_id = problem_of(post(s, "/v1/messages", {"subject": "a", "id": ""}), 422)
    assert empty_id["code"] == "EMPTY_ID"
    far = problem_of(post(s, "/v1/messages", {"subject": "a", "delay": "3000d"}), 422)
    assert far["code"] == "DELAY_TOO_LONG" and "max_delay" in far["detail"]
    dlq = problem_of(post(s, "/v1/messages", {"subject": "DLQ.a"}), 422)
    assert dlq["code"] == "INVALID_SUBJECT"
    # Sizes: the intake's body limit (4096 here), the request limit, the batch count.
    big = problem_of(post(s, "/v1/messages", {"subject": "a", "body": "x" * 5000}), 413)
    assert big["code"] == "BODY_TOO_LARGE" and "max_body_bytes" in big["detail"]
    huge = problem_of(post(s, "/v1/messages", b"x" * (2 * 16384 + 1024 * 1024 + 1)), 413)
    assert "over" in huge["detail"]
    many = {"messages": [{"subject": "a"}] * 1001}
    assert "at most 1,000" in problem_of(post(s, "/v1/batches", many), 413)["detail"]
    problem_of(post(s, "/v1/batches", {"messages": []}), 422)
    # Not found: a path, a message; method not allowed.
    problem_of(httpx.get(base_url(s) + "/v1/nothing"), 404)
    assert problem_of(httpx.get(base_url(s) + "/v1/messages/nope"), 404)["type"].endswith(
        "unknown-message"
    )
    problem_of(httpx.delete(base_url(s) + "/v1/messages/nope"), 404)
    problem_of(httpx.put(base_url(s) + "/v1/messages/nope"), 405)
    # Consumer names the broker refuses.
    pull = post(s, "/v1/subjects/a/groups/bad%01group/pull", {"consumer_id": "c"})
    assert "control characters" in problem_of(pull, 422)["detail"]
    pull = post(s, "/v1/subjects/bad!subject/groups/g/pull", {"consumer_id": "c"})
    assert "contains '!'" in problem_of(pull, 422)["detail"]
    commit = post(s, "/v1/subjects/a/groups/g/commit", {"offsets": [{"queue": 9, "offset": 0}]})
    assert "queues 0..1" in problem_of(commit, 422)["detail"]
    # And the server still serves.
    ok = post(s, "/v1/messages", {"subject": "a", "body_base64": base64.b64encode(b"\0").decode()})
    assert ok.status_code == 201 and len(ok.json()["id"]) == 32  # made by the server


def test_a_token_is_required_when_one_is_set(tmp_path, procs):
    server = procs.start(http_serve_process(tmp_path, config='[server]\ntoken = "s3cret"\n'))
    url = base_url(server)
    message = {"subject": "a", "delay": "1h"}
    missing = problem_of(httpx.post(url + "/v1/messages", json=message), 401)
    assert "Authorization: Bearer" in missing["detail"]
    wrong = httpx.post(url + "/v1/messages", json=message, headers={"Authorization": "Bearer nope"})
    assert problem_of(wrong, 401)["detail"].endswith("(the one given is wrong)")
    assert wrong.headers["www-authenticate"] == "Bearer"
    right = httpx.post(
        url + "/v1/messages", json=message, headers={"Authorization": "Bearer s3cret"}
    )
    assert right.status_code == 201
    assert httpx.get(url + "/openapi.json").status_code == 200  # the contract is open


def pull(server, group: str, consumer: str, wait_ms: int = 0, subject: str = "jobs") -> dict:
    body = {"consumer_id": consumer, "max_messages": 100, "wait_ms": wait_ms}
    response = post(server, f"/v1/subjects/{subject}/groups/{group}/pull", body)
    assert response.status_code == 200, response.text
    return response.json()


def pull_all(server, group: str, consumer: str, count: int, subject: str = "jobs") -> dict:
    """Pull until ``count`` messages came (each pull waits up to 2 s for more), for 20 s
    at most: a delivery or a rebalance late on a loaded machine may leave a pull empty."""
    deadline = time.monotonic() + 20
    got = pull(server, group, consumer, wait_ms=2000, subject=subject)
    while len(got["messages"]) < count:
        assert time.monotonic() < deadline, got
        more = pull(server, group, consumer, wait_ms=2000, subject=subject)
        got["messages"] += more["messages"]
        got["commit"] += more["commit"]
    return got


def ids_of(pulled: dict) -> set[str]:
    return {m["id"] for m in pulled["messages"]}


def test_http_consumers_share_a_group_and_get_uncommitted_messages_again(http_server):
    """Two HTTP members of one group split its two queues; a queue that moves to
    another member restarts at the committed offset, so what was pulled and not
    committed comes again (at least once); committed messages do not."""
    s = http_server
    jobs = {f"job-{i}" for i in range(8)}
    batch = {"messages": [{"subject": "jobs", "id": m, "body": m} for m in sorted(jobs)]}
    assert post(s, "/v1/batches", batch).json()["scheduled"] == 8
    alone = pull_all(s, "workers", "one", 8)  # the only member: both queues
    assert ids_of(alone) == jobs and {o["queue"] for o in alone["commit"]} == {0, 1}
    # "two" joins and gets one queue, from its committed offset: its 4 messages again.
    second = pull_all(s, "workers", "two", 4)
    assert len(second["messages"]) == 4 and len({o["queue"] for o in second["commit"]}) == 1
    assert pull(s, "workers", "one")["messages"] == []  # its own queue: nothing new
    # "one" leaves without committing: its queue goes to "two", with its 4 messages.
    leave = httpx.delete(base_url(s) + "/v1/subjects/jobs/groups/workers/members/one")
    assert leave.status_code == 204
    rest = pull_all(s, "workers", "two", 4)
    assert ids_of(second) | ids_of(rest) == jobs and not ids_of(second) & ids_of(rest)
    offsets = second["commit"] + rest["commit"]
    committed = post(s, "/v1/subjects/jobs/groups/workers/commit", {"offsets": offsets})
    assert committed.status_code == 200 and committed.json()["committed"] == offsets
    # Committed: a new member finds nothing; another group gets every message.
    httpx.delete(base_url(s) + "/v1/subjects/jobs/groups/workers/members/two")
    assert pull(s, "workers", "three", wait_ms=200)["messages"] == []
    assert ids_of(pull_all(s, "auditors", "a", 8)) == jobs


def listening_sockets(pid: int) -> int:
    """How many TCP sockets process ``pid`` has in LISTEN state (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                count += fields[3] == "0A" and fields[9] in inodes
    return count


def test_with_the_http_listener_off_nothing_listens_for_it(tmp_path, procs):
    off = ServeProcess(
        tmp_path / "off", "--broker-listen", "off", metrics_listen="off", http_listen="off"
    )
    on = ServeProcess(
        tmp_path / "on",
        "--broker-listen",
        "off",
        metrics_listen="off",
        http_listen=None,  # the default, moved to a free port by the environment
        env={"DELAYD_HTTP_LISTEN": "127.0.0.1:0"},
    )
    procs.start(off)
    procs.start(on)
    assert off.http_address is None and "http" not in off.stdout
    assert listening_sockets(off.proc.pid) == 1  # the intake listener alone
    assert on.http_address is not None
    assert listening_sockets(on.proc.pid) == 2
    assert httpx.get(base_url(on) + "/openapi.json").status_code == 200


def test_a_binary_and_an_http_consumer_share_one_group(http_server):
    """A Python client consumer and an HTTP member of the same group each get one of
    the subject's two queues: every message reaches exactly one of them."""
    from delayd.client import Consumer

    s = http_server
    host, port = s.broker_address
    with Consumer(f"{host}:{port}", subject="mixed", group="shared", consumer_id="bin") as binary:
        assert pull(s, "shared", "web", subject="mixed")["messages"] == []  # one queue each
        batch = {"messages": [{"subject": "mixed", "id": f"m-{i}"} for i in range(8)]}
        assert post(s, "/v1/batches", batch).json()["scheduled"] == 8
        over_http = ids_of(pull_all(s, "shared", "web", 4, subject="mixed"))
        over_binary = set()
        while len(over_binary) < 4:
            message = binary.receive(timeout_s=5)
            assert message is not None, over_binary
            over_binary.add(message.message_id)
        assert binary.receive(timeout_s=0.3) is None  # nothing of the other queue
    assert len(over_http) == 4 and over_http | over_binary == {f"m-{i}" for i in range(8)}


def members(broker_address: tuple[str, int], group: str = "g", subject: str = "s") -> int:
    """The members of consumer group ``group`` of ``subject`` the broker has."""
    return int(broker_stats(broker_address).get(f"group_members/{group}/{subject}", 0))


def test_sigterm_answers_a_long_poll_and_stops_the_server(tmp_path, procs):
    """The HTTP listener stops with the server: a pull waiting in a long poll is
    answered at once (empty), and the process exits 0 without waiting it out."""
    import threading

    server = procs.start(http_serve_process(tmp_path))
    answers: list[httpx.Response] = []
    body = {"consumer_id": "c", "wait_ms": 30_000}
    long_poll = threading.Thread(
        target=lambda: answers.append(post(server, "/v1/subjects/s/groups/g/pull", body))
    )
    long_poll.start()
    # Until the pull joined the group: a fixed half second was no longer than its
    # thread and client start can take on a loaded machine (a stop before the request
    # came would refuse it, not answer it).
    assert server.broker_address is not None
    poll(lambda: members(server.broker_address) == 1, 10, "the pull waiting in the broker")
    started = time.monotonic()
    assert server.stop() == 0
    long_poll.join(10)
    assert time.monotonic() - started < 4  # neither the poll (30 s) nor the grace (5 s)
    assert answers and answers[0].status_code == 200
    assert answers[0].json() == {"messages": [], "commit": []}


def test_an_http_member_that_stops_pulling_leaves_the_group(tmp_path, procs):
    """No pull for heartbeat_timeout_ms: the member is dropped, as a binary consumer
    that stops heartbeating, and its queue (with what it did not commit) moves."""
    config = "[broker]\nqueues_per_subject = 2\nheartbeat_timeout_ms = 1500\n"
    server = procs.start(http_serve_process(tmp_path, config=config))
    assert pull(server, "g", "quiet")["messages"] == []
    assert pull(server, "g", "busy")["messages"] == []  # one queue each
    batch = {"messages": [{"subject": "jobs", "id": f"j-{i}"} for i in range(4)]}
    assert post(server, "/v1/batches", batch).json()["scheduled"] == 4
    own = pull_all(server, "g", "busy", 2)  # its queue only
    assert len(own["messages"]) == 2 and len(own["commit"]) == 1
    busy_queue = own["commit"][0]["queue"]
    # "quiet" says nothing from now on; "busy" waits in a long poll (its heartbeat),
    # which the rebalance wakes once "quiet" timed out.
    rest = pull_all(server, "g", "busy", 2)
    assert len(rest["messages"]) == 2 and {o["queue"] for o in rest["commit"]} == {1 - busy_queue}
