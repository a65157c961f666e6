"""Structured outputs on the wire: every spelling of an output constraint, read into one (no Flask here).

Both generation endpoints take an output constraint in the forms clients send:

- OpenAI's ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}`` (any JSON
  object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``;
  llama.cpp's ``{"type": "json_schema" | "json_object", "schema": {...}}`` is the same schema, never
  ignored. On ``/v1/completions`` it is an extension.
- vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, or its JSON text), ``regex``,
  ``choice`` (a list of strings), ``grammar`` (Lark as llguidance reads it, or GBNF), ``json_object``.
- vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``, and
  llama.cpp's top-level ``json_schema`` and ``grammar`` (GBNF), mapped onto the same.

The result is a :class:`RequestConstraint`: the :class:`~model.grammar.compile.Constraint` and the
``param`` a refusal names. Two constraints in one request, a malformed one, or one the grammar
compiler refuses later (``wsgi_app.generation.grammars``) are a 400 naming that param, before any byte.
``strict: false`` is accepted and the schema enforced all the same: we never answer with text the
schema does not allow.

An object schema that does not say ``additionalProperties`` is closed (``false``), in every spelling:
OpenAI's strict mode requires every object closed, llama.cpp and vLLM's default backend read such
objects so, and an open one lets a model invent keys until ``max_tokens``. ``true`` or a schema is
kept, except under ``strict: true``, which OpenAI refuses for it (and so do we).
``structured_outputs.disable_additional_properties`` (vLLM's) says the same when true or absent;
``false`` keeps JSON Schema's reading, objects open.

Source: OpenAI API reference, "Chat Completions" ``response_format`` and the "Structured Outputs" guide;
vLLM docs, "Structured Outputs"; llama.cpp server README (``json_schema``, ``grammar``,
``response_format``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from model.grammar.compile import (
    MAX_CHOICES,
    MAX_CONSTRAINT_BYTES,
    Constraint,
    closed,
    open_object,
)
from wsgi_app.api.errors import invalid, quote_name
from wsgi_app.api.fields import loads_strict
from wsgi_app.api.naming import described_object
from wsgi_app.api.table import Field

# Every top-level field that carries an output constraint (each endpoint's field table holds them, so
# wsgi_app.api.table no longer refuses the other servers' spellings among them).
STRUCTURED_FIELD_NAMES = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "json_schema",
    "grammar",
)
STRUCTURED_FIELDS = tuple(Field(name) for name in STRUCTURED_FIELD_NAMES)  # POST bodies only
# structured_outputs' constraint keys, and the options that ask for what we always do.
_SO_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
_SO_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties")


@dataclass(frozen=True, slots=True)
class RequestConstraint:
    """A request's output constraint and the field it came from.

    Attributes:
        constraint: what to compile (its ``kind`` names it in logs and metrics).
        param: the ``param`` a refusal names (``response_format``, ``structured_outputs.json``...).
    """

    constraint: Constraint
    param: str


def parse_constraint(body: dict[str, Any]) -> RequestConstraint | None:
    """Return the body's one output constraint, or None when it has none (or ``type: text``).

    Raises:
        ApiError: 400 naming the field: a malformed constraint, or two of them in one request.
    """
    found: list[RequestConstraint] = []
    for name in STRUCTURED_FIELD_NAMES:
        value = body.get(name)
        if value is None:
            continue
        rc = _READERS[name](value, name)
        if rc is None:
            continue
        if found:
            raise invalid(
                f"A request takes one output constraint; '{found[0].param}' and '{rc.param}' are "
                "both given.",
                rc.param,
            )
        found.append(rc)
    return found[0] if found else None


def refuse_stop(
    constraint: RequestConstraint | None, stop: tuple[str, ...], param: str = "stop"
) -> RequestConstraint | None:
    """Return ``constraint`` when the request sends no ``stop`` strings beside it.

    A constrained answer ends where its constraint accepts (at once when nothing can follow), so
    a stop string can only cut it earlier, where the text is no complete value of the constraint
    (a JSON value without its end), and the answer would still say ``finish_reason: "stop"``,
    which OpenAI's clients read as a whole answer. Rather than answer so, the pair is refused
    before any byte. The chat template's own stop strings are not the request's and still apply.

    Args:
        constraint: the request's output constraint, or None.
        stop: the request's own stop strings.
        param: the wire's name for them (``stop``; Anthropic's ``stop_sequences``).

    Raises:
        ApiError: 400 naming ``param``, and the constraint's field in the message.
    """
    if constraint is not None and stop:
        raise invalid(
            f"'{param}' cannot be used with an output constraint ('{constraint.param}'): a stop "
            "string would cut the constrained answer before it is complete, yet end with "
            "finish_reason 'stop'. Send one of them (a regex or grammar can say where the "
            "answer ends).",
            param,
        )
    return constraint


def schema_constraint(
    value: Any, param: str, close: bool = True, strict: bool = False
) -> Constraint:
    """Return the constraint of a JSON Schema at ``param``: an object, or (vLLM) its JSON text; its
    objects closed unless they say otherwise (``model.grammar.schema.closed``) when ``close``;
    under OpenAI's ``strict``, an object that allows other properties is refused, as OpenAI
    refuses it. Every endpoint's JSON-schema output constraint is read here.

    Raises:
        ApiError: 400 naming ``param``: not an object (nor its JSON text), or open under ``strict``.
    """
    if isinstance(value, str):
        try:
            value = loads_strict(value)
        except ValueError as exc:
            raise invalid(f"'{param}' is not valid JSON: {exc}.", param) from None
    if isinstance(value, bool) and value:  # JSON Schema's `true`: any JSON value
        value = {}
    if not isinstance(value, dict):
        raise invalid(f"'{param}' must be a JSON Schema object.", param)
    if strict:
        refuse_open_object(value, param)
    return Constraint("json_schema", closed(value, MAX_CONSTRAINT_BYTES) if close else value)


def refuse_open_object(schema: dict[str, Any], param: str) -> None:
    """Refuse a schema sent with ``strict: true`` that has an object allowing other properties
    (``additionalProperties`` true or a schema): OpenAI's strict mode requires it false on every
    object. One that does not say is closed, not refused (:func:`_schema`).

    Raises:
        ApiError: 400 naming ``param``, the object's JSON pointer in the message.

    Source: OpenAI "Structured Outputs" guide, supported schemas ("additionalProperties: false
    must always be set in objects").
    """
    at = open_object(schema)
    if at is not None:
        raise invalid(
            f"'{param}' cannot be enforced: strict mode requires 'additionalProperties': false "
            f"on every object; the object at {at} allows other properties.",
            param,
        )


def _text(value: Any, param: str, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise invalid(f"'{param}' must be a non-empty string ({what}).", param)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(f"'{param}' contains a lone surrogate code point.", param) from None
    return value


def _choice(value: Any, param: str) -> Constraint:
    if not isinstance(value, list) or not value or len(value) > MAX_CHOICES:
        raise invalid(f"'{param}' must be a list of 1..{MAX_CHOICES} strings.", param)
    return Constraint(
        "choice", tuple(_text(s, f"{param}[{i}]", "a choice") for i, s in enumerate(value))
    )


def _response_format(value: Any, param: str) -> RequestConstraint | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise invalid(f"'{param}' must be an object with a string 'type'.", param)
    kind = value["type"]
    allowed = {"text": ("type",), "json_object": ("type", "schema")}.get(
        kind, ("type", "json_schema", "schema")
    )
    if kind not in ("text", "json_object", "json_schema"):
        raise invalid(f"Invalid '{param}.type': {quote_name(kind)!r}.", param)
    for key in value:
        if key not in allowed:
            at = f"{param}.{quote_name(key)}"
            raise invalid(f"Unrecognized request argument supplied: {at}", at)
    if kind == "text":
        return None
    outer = value.get("schema")  # llama.cpp's place for the schema
    inner = _json_schema_object(value.get("json_schema"), f"{param}.json_schema")
    if outer is not None and inner is not None:
        raise invalid(
            f"'{param}' gives a schema twice ('schema' and 'json_schema.schema'); send one.", param
        )
    if kind == "json_object" and outer is None:
        return RequestConstraint(Constraint("json_object"), param)
    schema = outer if outer is not None else inner
    if schema is None:
        raise invalid(f"'{param}.json_schema.schema' is required for type 'json_schema'.", param)
    strict = outer is None and value["json_schema"].get("strict") is True
    return RequestConstraint(schema_constraint(schema, param, strict=strict), param)


def text_format(value: Any, param: str = "text.format") -> RequestConstraint | None:
    """Read the Responses API's ``text.format``: ``{"type": "text"}`` (no constraint),
    ``{"type": "json_object"}``, or ``{"type": "json_schema", "name", "schema", "strict",
    "description"}`` (the chat's ``json_schema`` object, flat beside ``type``), enforced as
    ``response_format`` is.

    Raises:
        ApiError: 400 naming ``param`` (``text.format``) or its key at fault: a missing or
            unknown ``type``, an unknown key, a malformed name, description or strict flag, a
            missing or malformed ``schema``.

    Source: OpenAI API reference, "Responses" (create: ``text.format``).
    """
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise invalid(f"'{param}' must be an object with a string 'type'.", param)
    kind = value["type"]
    if kind not in ("text", "json_object", "json_schema"):
        raise invalid(
            f"Invalid '{param}.type': {quote_name(kind)!r}; expected 'text', 'json_object' or "
            "'json_schema'.",
            f"{param}.type",
        )
    keys = (
        ("type", "name", "schema", "strict", "description") if kind == "json_schema" else ("type",)
    )
    described_object(value, param, keys, name_required=False)
    if kind == "text":
        return None
    if kind == "json_object":
        return RequestConstraint(Constraint("json_object"), param)
    if value.get("schema") is None:
        at = f"{param}.schema"
        raise invalid(f"'{at}' is required for type 'json_schema'.", at)
    return RequestConstraint(schema_constraint(value["schema"], param), param)


def _json_schema_object(value: Any, param: str) -> Any:
    """Check OpenAI's ``json_schema`` object and return its ``schema`` (None when absent)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid(f"'{param}' must be an object.", param)
    described_object(value, param, ("name", "schema", "strict", "description"), name_required=False)
    return value.get("schema")


def _structured_outputs(value: Any, param: str) -> RequestConstraint:
    if not isinstance(value, dict):
        raise invalid(f"'{param}' must be an object.", param)
    kinds = []
    for key, item in value.items():
        at = f"{param}.{quote_name(key)}"
        if key in _SO_OPTIONS:  # we never fall back, always write compact JSON, close objects
            if item is not None and not isinstance(item, bool):
                raise invalid(f"'{at}' must be a boolean.", at)
        elif key == "json_object":
            if item is not None and not isinstance(item, bool):
                raise invalid(f"'{at}' must be a boolean.", at)
            if item:
                kinds.append(key)
        elif key in _SO_KINDS:
            if item is not None:
                kinds.append(key)
        else:
            raise invalid(f"'{at}' is not supported by this server.", at)
    if len(kinds) != 1:
        raise invalid(
            f"'{param}' must hold exactly one of 'json', 'regex', 'choice', 'grammar' or "
            f"'json_object'; got {len(kinds)}.",
            param,
        )
    key = kinds[0]
    at = f"{param}.{key}"
    if key == "json_object":
        return RequestConstraint(Constraint("json_object"), at)
    if key == "json":  # objects closed unless the request asks for JSON Schema's open ones
        close = value.get("disable_additional_properties") is not False
        return RequestConstraint(schema_constraint(value[key], at, close), at)
    return RequestConstraint(_KIND_READERS[key](value[key], at), at)


def _grammar(value: Any, param: str) -> Constraint:
    return Constraint("grammar", _text(value, param, "a Lark or GBNF grammar"))


def _regex(value: Any, param: str) -> Constraint:
    return Constraint("regex", _text(value, param, "a regular expression"))


_KIND_READERS = {"json": schema_constraint, "regex": _regex, "choice": _choice, "grammar": _grammar}


def _plain(read: Any) -> Any:
    return lambda value, name: RequestConstraint(read(value, name), name)


_READERS = {
    "response_format": _response_format,
    "structured_outputs": _structured_outputs,
    "guided_json": _plain(schema_constraint),
    "guided_regex": _plain(_regex),
    "guided_choice": _plain(_choice),
    "guided_grammar": _plain(_grammar),
    "json_schema": _plain(schema_constraint),
    "grammar": _plain(_grammar),
}
