"""The OpenAPI document of the HTTP API, as the server serves it at /openapi.json.

``python -m delayd.server.http.openapi > docs/openapi.json`` writes the copy kept in docs/
(tests/test_http_api.py checks that it equals the served one).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from delayd.server.http.routes import Backend, build_app


def openapi_document() -> dict[str, Any]:
    """The document; it depends on the routes only, not on a running server."""
    backend = Backend(None, None, None, None, None)  # type: ignore[arg-type]
    return build_app(backend).openapi()


def render(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render(openapi_document()))
