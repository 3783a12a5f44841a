"""The HTTP API's offset commit on a member of a replicated group, in process (a fake
gate and a fake membership): a member that stops leading while a commit is under way
answers the NOT_LEADER problem (421 naming the leader, 503 while none is known), as
the HTTP API answers NOT_LEADER elsewhere (docs/http.md), never a 500."""

from __future__ import annotations

from pathlib import Path

import httpx
import trio

from delayd.broker.broker import Broker
from delayd.protocol import Message
from delayd.server.http import Backend, build_app
from storage.errors import StorageError
from tests.test_broker_gate import FakeGate, gated_broker

SUBJECT = "orders"
GROUP = "g"


class FakeMembership:
    """A member that leads until ``step_down``; then it names ``leader`` (None: no
    leader known yet)."""

    def __init__(self) -> None:
        self.leading = True
        self.leader: str | None = None

    def may_lead(self) -> bool:
        return self.leading

    def refusal(self, listener: str) -> str:
        return f"this member does not lead (leader {self.leader or 'unknown'})"

    def leader_address(self, listener: str) -> str | None:
        return self.leader

    def step_down(self, leader: str | None) -> None:
        self.leading = False
        self.leader = leader


def client_for(broker: Broker, membership: FakeMembership) -> httpx.AsyncClient:
    backend = Backend(None, broker, None, None, print, membership)  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=build_app(backend))
    return httpx.AsyncClient(transport=transport, base_url="http://delayd")


async def pulled(client: httpx.AsyncClient, broker: Broker, gate: FakeGate) -> list[dict]:
    """Store two messages (acknowledged by the gate) and pull them: the commit list."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(broker.send_batch, [Message(f"m-{i}", SUBJECT) for i in range(2)])
        await trio.sleep(0.05)
        gate.move(commitlog=broker.store.commitlog.end_offset)
    path = f"/v1/subjects/{SUBJECT}/groups/{GROUP}/pull"
    answer = await client.post(path, json={"consumer_id": "c", "max_messages": 10})
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["messages"]) == 2
    return answer.json()["commit"]


def assert_not_leader(answer: httpx.Response, status: int, leader: str | None) -> None:
    assert answer.status_code == status, answer.text
    problem = answer.json()
    assert problem["code"] == "NOT_LEADER"
    assert problem.get("leader") == (None if leader is None else f"http://{leader}/v1")


async def commit_while_stepping_down(
    tmp_path: Path, leader: str | None, *, follow: bool
) -> httpx.Response:
    """A commit waits for the group; meanwhile the member steps down (``follow``: and
    its broker follows the new leader already)."""
    async with gated_broker(tmp_path) as (broker, gate):
        membership = FakeMembership()
        async with client_for(broker, membership) as client:
            commit = await pulled(client, broker, gate)
            answers: list[httpx.Response] = []

            async def post() -> None:
                path = f"/v1/subjects/{SUBJECT}/groups/{GROUP}/commit"
                answers.append(await client.post(path, json={"offsets": commit}))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(post)
                await trio.sleep(0.1)
                assert answers == []  # waiting for the group
                membership.step_down(leader)
                if follow:
                    broker.follow()
                gate.step_down()
            return answers[0]


async def test_a_commit_held_when_the_member_steps_down_is_421_naming_the_leader(
    tmp_path: Path,
) -> None:
    answer = await commit_while_stepping_down(tmp_path, "10.0.0.2:8080", follow=True)
    assert_not_leader(answer, 421, "10.0.0.2:8080")


async def test_a_commit_held_when_no_leader_is_known_yet_is_503(tmp_path: Path) -> None:
    answer = await commit_while_stepping_down(tmp_path, None, follow=False)
    assert_not_leader(answer, 503, None)
    assert answer.json()["retryable"] is True


async def test_a_commit_reaching_a_broker_that_follows_already_is_not_leader(
    tmp_path: Path,
) -> None:
    """The member stepped down after the request was let in, before the commit reached
    the broker: the broker refuses it as a follower's, and the answer says who leads."""
    async with gated_broker(tmp_path) as (broker, gate):
        membership = FakeMembership()
        async with client_for(broker, membership) as client:
            commit = await pulled(client, broker, gate)
            broker.follow()  # the membership has not caught up yet: it still may lead
            path = f"/v1/subjects/{SUBJECT}/groups/{GROUP}/commit"
            answer = await client.post(path, json={"offsets": commit})
            assert answer.status_code in (421, 503), answer.text
            assert answer.json()["code"] == "NOT_LEADER"


async def test_a_commit_whose_flush_fails_as_the_member_steps_down_is_not_leader(
    tmp_path: Path, monkeypatch
) -> None:
    """Demoted while it flushed the commit: the follower's cut closed the offsets file
    under the flush. The failure is the demotion's, answered NOT_LEADER, not a 500."""
    async with gated_broker(tmp_path) as (broker, gate):
        membership = FakeMembership()
        async with client_for(broker, membership) as client:
            commit = await pulled(client, broker, gate)

            def cut_under_the_flush(version: int | None = None) -> None:
                membership.step_down("10.0.0.2:8080")
                raise StorageError("offsets/00000000: the file was closed")

            path = f"/v1/subjects/{SUBJECT}/groups/{GROUP}/commit"
            with monkeypatch.context() as patched:
                patched.setattr(broker.offsets, "flush", cut_under_the_flush)
                answer = await client.post(path, json={"offsets": commit})
            assert_not_leader(answer, 421, "10.0.0.2:8080")


async def test_a_pull_on_a_member_whose_broker_follows_already_is_not_leader(tmp_path: Path):
    """The broker follows the new leader before the member's view says it no longer
    leads: the pull is refused as NOT_LEADER (retry at the leader), not as bad input."""
    async with gated_broker(tmp_path) as (broker, _gate):
        membership = FakeMembership()
        async with client_for(broker, membership) as client:
            broker.follow()
            path = f"/v1/subjects/{SUBJECT}/groups/{GROUP}/pull"
            answer = await client.post(path, json={"consumer_id": "c", "max_messages": 10})
            assert_not_leader(answer, 503, None)
