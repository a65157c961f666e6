"""``GET /openapi.json``: the HTTP contract as an OpenAPI 3.1 document.

The document is ``wsgi_app/openapi.json``, shipped as package data and served byte for byte (compact
whitespace aside), so the file in the repository is the contract clients and fuzzers read. Tests check
that every route of the app is in it and that real answers validate against it.

Source: OpenAPI Specification 3.1.0.
"""

from __future__ import annotations

import importlib.resources
import json
from functools import cache
from typing import Any

from flask import Blueprint, Response

from wsgi_app.api.errors import json_bytes

bp = Blueprint("openapi", __name__)

DOCUMENT = "openapi.json"


@cache
def document() -> dict[str, Any]:
    """Return the OpenAPI document (parsed once per process).

    Raises:
        FileNotFoundError: the package was installed without its data file.
    """
    return json.loads(importlib.resources.files("wsgi_app").joinpath(DOCUMENT).read_text("utf-8"))


@cache
def _document_bytes() -> bytes:
    return json_bytes(document())


@bp.get("/openapi.json")
def openapi_json() -> Response:
    """Serve the OpenAPI document."""
    return Response(_document_bytes(), content_type="application/json")
