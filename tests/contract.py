"""Check real HTTP answers against the OpenAPI document (``wsgi_app/openapi.json``).

Each answer is looked up by (path template, method, status): its required headers must be there and match
their schemas, its ``Content-Type`` must be one the document lists, and its body must validate: a JSON
body against the media type's schema, an event stream event by event (each event as
``{"data", "event", "id"?, "retry"?}``, OpenAPI 3.2's reading of ``text/event-stream``) and each JSON
``data`` against the ``contentSchema`` it declares (``[DONE]`` last where ``data`` allows it).

Source: OpenAPI Specification 3.1.0 and 3.2.0 (sequential media types); JSON Schema 2020-12.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from tests.sse import events as parse_sse

BASE = "urn:greenserve:openapi"
# The document the server serves at /openapi.json, as shipped in the package.
DOC_PATH = Path(__file__).resolve().parent.parent / "wsgi_app" / "openapi.json"


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


class Contract:
    """The OpenAPI document, with a JSON Schema registry that resolves its internal ``$ref``\\ s."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        resource = Resource.from_contents(doc, default_specification=DRAFT202012)
        self.registry = Registry().with_resource(BASE, resource)

    def validator(self, pointer: str) -> Draft202012Validator:
        """A validator for the schema at JSON pointer ``pointer`` of the document."""
        return Draft202012Validator({"$ref": f"{BASE}#{pointer}"}, registry=self.registry)

    def _resolve(self, pointer: str) -> tuple[str, dict[str, Any]]:
        node: Any = self.doc
        for token in pointer.lstrip("/").split("/"):
            node = node[token.replace("~1", "/").replace("~0", "~")]
        if "$ref" in node:
            return self._resolve(node["$ref"].removeprefix("#"))
        return pointer, node

    def response(self, path: str, method: str, status: int) -> tuple[str, dict[str, Any]]:
        """Return (pointer, response object) documented for ``method path`` answering ``status``.

        Raises:
            AssertionError: the document lists no such path, method or status.
        """
        paths = self.doc["paths"]
        assert path in paths, f"{path} is not documented"
        assert method.lower() in paths[path], f"{method} {path} is not documented"
        responses = paths[path][method.lower()]["responses"]
        assert str(status) in responses, f"{method} {path} does not document {status}"
        return self._resolve(f"/paths/{_escape(path)}/{method.lower()}/responses/{status}")

    def check(
        self, path: str, method: str, status: int, headers: dict[str, str], body: bytes
    ) -> int:
        """Validate one answer (``headers`` with lower-case names); return how many values were checked.

        Raises:
            AssertionError, jsonschema.ValidationError: the answer breaks the document.
        """
        pointer, response = self.response(path, method, status)
        checked = 0
        for name in response.get("headers", {}):
            hpointer, header = self._resolve(f"{pointer}/headers/{_escape(name)}")
            value = headers.get(name.lower())
            if header.get("required"):
                assert value is not None, f"{status} lacks required header {name}"
            if value is not None:
                self.validator(f"{hpointer}/schema").validate(value)
                checked += 1
        content = response.get("content")
        if not content:
            assert body == b"", body[:80]
            return checked
        ctype = headers.get("content-type", "").split(";")[0].strip()
        assert ctype in content, f"{status} answered {ctype!r}, documented: {list(content)}"
        media = f"{pointer}/content/{_escape(ctype)}"
        if ctype == "application/json":
            self.validator(f"{media}/schema").validate(json.loads(body))
            return checked + 1
        if ctype == "text/plain":
            self.validator(f"{media}/schema").validate(body.decode())
            return checked + 1
        assert ctype == "text/event-stream"
        # OpenAI's streams end with [DONE] (``data`` is "[DONE]" or else JSON); Anthropic's named
        # events are all JSON.
        data = content[ctype]["schema"]["properties"]["data"]
        done = "else" in data
        at = f"{media}/schema/properties/data" + ("/else" if done else "")
        payload = self.validator(f"{at}/contentSchema")
        assert (data["else"] if done else data)["contentMediaType"] == "application/json"
        events = parse_sse(body)
        for event in events:
            self.validator(f"{media}/schema").validate(event)
            if event["data"] != "[DONE]":
                payload.validate(json.loads(event["data"]))
        assert events and (events[-1]["data"] == "[DONE]") == done
        return checked + len(events)
