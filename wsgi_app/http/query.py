"""The query string of a GET generation stream as the JSON body it stands for (``EventSource``).

``EventSource`` can only GET, so a stream's request is its query string: each parameter is converted
as the endpoint's field table (``wsgi_app.api.table``) says its field is carried (numbers as in JSON,
booleans as ``true``/``false``, ``stop`` repeatable) into the body a POST would send, which the
endpoint's parser then validates exactly like one; an unknown parameter is passed on as text, to be
ignored and named as an unknown body field is. Names and values must be UTF-8 once percent-decoded (as
a POST body must be).

Source: WHATWG URL Standard, "application/x-www-form-urlencoded parsing"; WHATWG HTML Living
Standard, §9.2 "Server-sent events"; docs/ARCHITECTURE.md §8.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import unquote_to_bytes

from werkzeug.datastructures import MultiDict

from wsgi_app.api.chat import FIELDS as CHAT_FIELDS
from wsgi_app.api.completions import FIELDS as COMPLETION_FIELDS
from wsgi_app.api.errors import invalid
from wsgi_app.api.fields import loads_strict
from wsgi_app.api.table import BOOLEAN, JSON, LIST, NUMBER, TEXT, FieldTable

AUTH_PARAMS = ("api_key",)  # read by wsgi_app.http.auth, not a request field
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


def _number(name: str, raw: str) -> int | float:
    if _JSON_NUMBER.fullmatch(raw):
        try:
            # int for integer literals, float otherwise: the types a JSON body would have
            return json.loads(raw)
        except ValueError:  # an integer past Python's digit limit
            pass
    raise invalid(f"Query parameter '{name}' must be a number, got {raw[:40]!r}.", name)


def _boolean(name: str, raw: str) -> bool:
    if raw not in ("true", "false"):
        raise invalid(f"Query parameter '{name}' must be true or false, got {raw[:40]!r}.", name)
    return raw == "true"


def check_query_utf8(query: str) -> None:
    """Refuse a query string whose names or values are not UTF-8 once percent-decoded.

    werkzeug decodes ``request.args`` with replacement characters; a POST body that is not UTF-8 is a
    400, so the same prompt sent as a query must be too, not generated from with U+FFFD in it.

    Args:
        query: the WSGI ``QUERY_STRING`` (the raw bytes decoded as Latin-1, PEP 3333).

    Raises:
        ApiError: 400 naming the parameter whose name or value does not decode.

    Source: WHATWG URL Standard, "application/x-www-form-urlencoded parsing" (percent-decoded bytes,
    then UTF-8); PEP 3333 for the Latin-1 environ strings.
    """
    for pair in query.split("&"):
        name, _, value = pair.partition("=")
        raw_name = _form_bytes(name)
        try:
            raw_name.decode("utf-8")
            _form_bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            param = raw_name.decode("utf-8", "replace")[:40]
            raise invalid(
                f"Query parameter '{param}' is not valid UTF-8 once percent-decoded: "
                f"{exc.reason} at byte {exc.start}.",
                param,
            ) from None


def _form_bytes(part: str) -> bytes:
    # Latin-1 gives back the bytes the client sent (a server that broke PEP 3333 gets "?" instead).
    return unquote_to_bytes(part.replace("+", " ").encode("latin-1", "replace"))


def query_body(
    args: MultiDict, table: FieldTable = COMPLETION_FIELDS, *, aliases: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Convert a query string into the JSON body it stands for (``stream`` always true).

    Each parameter is converted as ``table`` says its field is carried (:data:`TEXT` as sent,
    :data:`NUMBER` as a JSON number, :data:`BOOLEAN` as ``true``/``false``, :data:`LIST` repeatable,
    :data:`JSON` one strict JSON document); an empty number or boolean is absent, as JSON ``null`` is.
    A parameter the table does not know is kept as text (a list when repeated): the parser ignores it
    and names it, as it does an unknown body field (or refuses another server's constraint field).

    Args:
        args: the parsed query string.
        table: the endpoint's fields (the completion's by default).
        aliases: boolean parameters the caller maps itself (the chat's ``include_usage``).

    Returns:
        A dict for the endpoint's parser (``parse_completion_request``, ``parse_chat_request``).

    Raises:
        ApiError: 400 naming the parameter that only a POST body can carry, that repeats, or that does
            not convert to its field's type.
    """
    body: dict[str, Any] = {"stream": True}
    for name in dict.fromkeys(args):
        if name in AUTH_PARAMS:
            continue
        kind = BOOLEAN if name in aliases else table.query_kind(name)
        if kind is None and name in table.names:
            raise invalid(
                f"'{name}' cannot be sent on the EventSource stream; POST a JSON body to use it.",
                name,
            )
        values = args.getlist(name)
        if kind is None:  # unknown: passed on as sent, for the parser to ignore and name
            body[name] = values[0] if len(values) == 1 else values
            continue
        if kind == LIST:
            body[name] = values
            continue
        if len(values) > 1:
            raise invalid(f"Query parameter '{name}' is given more than once.", name)
        raw = values[0]
        if kind == TEXT:
            body[name] = raw
        elif kind == JSON:
            body[name] = _json(name, raw)
        elif raw == "":
            continue  # an empty form field: absent, as JSON null is
        elif kind == NUMBER:
            body[name] = _number(name, raw)
        else:
            body[name] = _boolean(name, raw)
    return body


def _json(name: str, raw: str) -> Any:
    try:  # the same strict reader as a POST body: no NaN, no repeated key
        return loads_strict(raw)
    except ValueError as exc:
        raise invalid(f"Query parameter '{name}' must be strict JSON: {exc}.", name) from None


def chat_query_body(args: MultiDict) -> dict[str, Any]:
    """Convert a ``GET /v1/chat/completions`` query string into the chat body it stands for:
    ``messages`` is one parameter holding the JSON list of messages, ``include_usage=true`` stands
    for ``stream_options.include_usage``, the rest as :func:`query_body` converts them.

    Raises:
        ApiError: 400 as :func:`query_body`.
    """
    body = query_body(args, CHAT_FIELDS, aliases=("include_usage",))
    if body.pop("include_usage", False):
        body["stream_options"] = {"include_usage": True}
    return body
