"""Each endpoint's field table: the one list of its top-level fields (no Flask here).

A :class:`FieldTable` says which fields an endpoint knows, which of them it refuses (documented but
not implemented), and how a GET query string carries each (``wsgi_app.http.query``); everything else
a body sends is ignored and named (``X-Ignored-Fields``), except another server's constraint field.

Source: OpenAI API reference, "Completions" and "Chat Completions"; DESIGN.md §5 (the v0 contract:
unknown fields are ignored).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from wsgi_app.api.errors import invalid

# How a GET query string carries a field (``wsgi_app.http.query``): its text as sent, a number as in
# JSON, ``true``/``false``, a repeatable parameter (a list of texts), one parameter holding strict JSON.
TEXT, NUMBER, BOOLEAN, LIST, JSON = "text", "number", "boolean", "list", "json"


@dataclass(frozen=True, slots=True)
class Field:
    """One top-level request field of an endpoint.

    Attributes:
        name: the wire name.
        query: how a GET query string carries it (:data:`TEXT`, :data:`NUMBER`, :data:`BOOLEAN`,
            :data:`LIST`, :data:`JSON`), or None when only a POST body can.
        unsupported: a documented field this server does not implement: any non-null value is a 400.
    """

    name: str
    query: str | None = None
    unsupported: bool = False


class FieldTable:
    """The top-level fields of one endpoint: what is known, what is refused, what a query carries.

    Args:
        fields: the endpoint's fields, each named once.

    Raises:
        ValueError: a name given twice.
    """

    def __init__(self, fields: Iterable[Field]) -> None:
        self.fields = tuple(fields)
        self.names = frozenset(f.name for f in self.fields)
        if len(self.names) != len(self.fields):
            raise ValueError("a field is named twice")
        self.unsupported = tuple(f.name for f in self.fields if f.unsupported)
        self._query = {f.name: f.query for f in self.fields}

    def check(self, body: dict[str, Any]) -> tuple[str, ...]:
        """Return :meth:`unknown` as ``X-Ignored-Fields`` shows them (:func:`shown_names`).

        Raises:
            ApiError: as :meth:`unknown`.
        """
        return shown_names(self.unknown(body))

    def unknown(self, body: dict[str, Any]) -> list[str]:
        """Refuse another server's constraint field; return the names of the fields ``body`` sends
        that this table does not know (ignored), as sent (an endpoint that ignores more, such as
        a tool's schema keyword, shows them all at once with :func:`shown_names`).

        Unknown fields are noise a client written for another server sends (vLLM, llama.cpp and
        pydantic-based servers ignore them too); a field that would change the answer's meaning is
        never noise: it is either in the table (and refused there when unsupported) or in
        :data:`CONSTRAINT_FIELDS`.

        Raises:
            ApiError: 400 naming the first field of :data:`CONSTRAINT_FIELDS` that ``body`` sends
                with a non-null value.

        Source: DESIGN.md §5, the v0 HTTP contract ("unknown fields are ignored").
        """
        for name in CONSTRAINT_FIELDS:
            if body.get(name) is not None and name not in self.names:
                raise invalid(
                    f"'{name}' (another server's constrained-output field) is not supported by "
                    "this server; remove it for unconstrained text.",
                    name,
                )
        return [name for name in body if name not in self.names]

    def query_kind(self, name: str) -> str | None:
        """Return how a query string carries ``name`` (None: POST only, or not a field)."""
        return self._query.get(name)

    def query_names(self, kind: str) -> tuple[str, ...]:
        """Return the fields a query string carries as ``kind``, in table order."""
        return tuple(f.name for f in self.fields if f.query == kind)


# Other servers' fields that constrain the output and that no table knows: ignoring one would answer
# unconstrained text to a client that asked for JSON, so a non-null value is a 400 naming it. vLLM's
# guided_* and llama.cpp's top-level json_schema and grammar left this list: the endpoint tables hold
# them and wsgi_app.api.structured enforces them. Ollama's format stays (its native API, not ours).
CONSTRAINT_FIELDS = ("format",)
MAX_SHOWN_NAMES = 32
MAX_SHOWN_NAME_CHARS = 64
# RFC 9110 token characters less "%" (the escape), "+" (the overflow mark) and "'" (the empty name).
_NAME_SAFE = "!#$&*-.^_`|~"
EMPTY_NAME = "''"


def shown_names(names: Iterable[str]) -> tuple[str, ...]:
    """Return client-sent field names as an ``X-Ignored-Fields`` header lists them: sorted, at most
    :data:`MAX_SHOWN_NAMES` (then ``+<how many more>``), each cut to :data:`MAX_SHOWN_NAME_CHARS`
    characters and percent-encoded outside the RFC 9110 token characters (so a name never splits the
    comma-separated list nor carries a byte a header cannot); the empty name is :data:`EMPTY_NAME`.

    Source: RFC 9110 §5.6.2 (tokens), RFC 3986 §2.1 (percent-encoding).
    """
    ordered = sorted(names)
    shown = [
        quote(name[:MAX_SHOWN_NAME_CHARS].encode("utf-8", "surrogatepass"), safe=_NAME_SAFE)
        or EMPTY_NAME
        for name in ordered[:MAX_SHOWN_NAMES]
    ]
    if len(ordered) > MAX_SHOWN_NAMES:
        shown.append(f"+{len(ordered) - MAX_SHOWN_NAMES}")
    return tuple(shown)


# The fields of both generation endpoints: OpenAI's, and the extensions shared with vLLM (top_k, min_p,
# ignore_eos).
SHARED_FIELDS = (
    Field("model", TEXT),
    Field("temperature", NUMBER),
    Field("top_p", NUMBER),
    Field("top_k", NUMBER),
    Field("min_p", NUMBER),
    Field("presence_penalty", NUMBER),
    Field("frequency_penalty", NUMBER),
    Field("seed", NUMBER),
    Field("n", NUMBER),
    Field("stop", LIST),
    Field("logit_bias"),
    Field("stream"),
    Field("stream_options"),
    Field("user", TEXT),
    Field("ignore_eos", BOOLEAN),
    Field(
        "cache_salt", TEXT
    ),  # vLLM's: only requests with the same salt share cached prompt blocks
)
