"""schemathesis against the OpenAPI document a real ``delayd serve`` serves: generated
requests, valid and not, to every operation; no answer may be a 5xx, and every answer
must match the document (status code, content type, headers, body schema), and a
request with a wrong token must be refused.

Not checked: that every schema-valid request is accepted. The document gives the
shapes; the intake's rules (a subject's characters, max_delay, an id that is printable
text) are answered 422 with the intake's own words, as for a binary send.
"""

from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.intake_support import ServeProcess
from tests.process_support import ROOT

pytestmark = pytest.mark.slow

OPENAPI = ROOT / "docs" / "openapi.json"
# Pulls return at once (a long poll per example would take the whole budget).
# With a token: the document declares bearer auth, and schemathesis checks that a
# request with a wrong one is refused.
TOKEN = "schemathesis-token"
CONFIG = f'[server]\ntoken = "{TOKEN}"\n\n[broker]\nmax_wait_ms = 10\nqueues_per_subject = 2\n'
EXAMPLES = 40  # per operation and mode: about 30 s in all


@pytest.fixture(scope="module")
def served_schema(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("schemathesis")
    config = tmp_path / "serve.toml"
    config.write_text(CONFIG)
    server = ServeProcess(
        tmp_path / "data",
        "--config",
        str(config),
        metrics_listen="off",
        http_listen="127.0.0.1:0",
    )
    with server:
        assert server.http_address is not None
        yield schemathesis.openapi.from_url(
            "http://{}:{}/openapi.json".format(*server.http_address)
        )


OPERATIONS = [
    (path, method)
    for path, methods in json.loads(OPENAPI.read_text())["paths"].items()
    for method in methods
]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize(("path", "method"), OPERATIONS)
def test_no_5xx_and_every_answer_matches_the_document(served_schema, path, method, mode):
    """``mode``: requests that match the document, or that break it (wrong types,
    missing fields, values out of range), which must be refused with a 4xx."""
    operation = served_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    def answers_within_the_document(case):
        case.call_and_validate(
            headers={"Authorization": f"Bearer {TOKEN}"},
            excluded_checks=[positive_data_acceptance],
            timeout=10,
        )

    answers_within_the_document()
