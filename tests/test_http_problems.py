"""The HTTP status of the intake's refusals, in process (delayd.server.http.problems): a
full disk, a busy server and a failing log, which a real server rarely shows."""

from __future__ import annotations

import httpx

from delayd.protocol import ResultCode, SendResult
from delayd.server.http import Backend, build_app
from storage.errors import StorageError


class RefusingIntake:
    """An IntakePath stand-in whose sends all get ``code``, or raise ``error``."""

    def __init__(self, code: ResultCode | None = None, error: Exception | None = None) -> None:
        self.code = code
        self.error = error

    async def send_batch(self, messages):
        if self.error is not None:
            raise self.error
        return [SendResult(self.code, f"refused: {self.code.name}") for _ in messages]


def client_for(intake, failures: list | None = None) -> httpx.AsyncClient:
    on_failure = (failures if failures is not None else []).append
    backend = Backend(intake, None, None, None, on_failure)  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=build_app(backend))
    return httpx.AsyncClient(transport=transport, base_url="http://delayd")


async def test_a_full_disk_is_507_and_busy_503_both_retryable_with_retry_after():
    for code, status in ((ResultCode.DISK_FULL, 507), (ResultCode.BUSY, 503)):
        async with client_for(RefusingIntake(code)) as client:
            one = await client.post("/v1/messages", json={"subject": "s"})
            batch = await client.post("/v1/batches", json={"messages": [{"subject": "s"}] * 3})
        for response in (one, batch):  # a batch refused whole is answered as one
            assert response.status_code == status
            assert response.headers["retry-after"] == "1"
            problem = response.json()
            assert problem["code"] == code.name and problem["retryable"] is True


async def test_a_refusal_for_the_message_itself_is_not_retryable():
    async with client_for(RefusingIntake(ResultCode.BODY_TOO_LARGE)) as client:
        response = await client.post("/v1/messages", json={"subject": "s"})
    assert response.status_code == 413 and "retry-after" not in response.headers
    assert response.json()["retryable"] is False


async def test_a_log_that_cannot_be_written_stops_the_server_and_answers_503():
    failures: list = []
    error = StorageError("fsync failed: EIO")
    async with client_for(RefusingIntake(error=error), failures) as client:
        response = await client.post("/v1/messages", json={"subject": "s"})
    assert response.status_code == 503 and "fsync failed" in response.json()["detail"]
    assert failures == [error]  # handed to the server, which stops on it
