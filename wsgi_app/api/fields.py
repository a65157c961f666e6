"""The request fields both generation endpoints share, read from a strict JSON body (no Flask here).

Strict JSON (no NaN, no repeated key), and the sampling, seed and stream fields of OpenAI's
Completions and Chat Completions parsed once for both, with the typed readers every field uses:
every violation is a 400 naming its ``param``. Which fields an endpoint has is its table's
(``wsgi_app.api.table``).

Source: OpenAI API reference, "Completions" and "Chat Completions"; RFC 8259 (JSON).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from model.sampling import SamplingParams
from wsgi_app.api.errors import ApiError, invalid, quote_name

MAX_MODEL_CHARS = 256
MAX_STOP = 4
SEED_LIMIT = 1 << 64


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {quote_name(key)!r}")
        obj[key] = value
    return obj


def loads_strict(text: str) -> Any:
    """Parse ``text`` as strict JSON: no ``NaN``/``Infinity`` literals, no repeated key.

    Raises:
        ValueError: the text is not such JSON, or nests too deep (the message says why).

    Source: RFC 8259 (JSON), which leaves duplicate names undefined; we refuse them rather than guess.
    """
    try:
        return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def decode_json_body(body: bytes) -> dict[str, Any]:
    """Parse a request body as one strict JSON object.

    Raises:
        ApiError: 400 when the body is not UTF-8, not JSON, uses ``NaN``/``Infinity`` literals, repeats a
            key, or is not an object.

    Source: RFC 8259 (JSON), which leaves duplicate names undefined; we refuse them rather than guess.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(
            f"Request body is not valid UTF-8: {exc.reason} at byte {exc.start}.", None
        ) from None
    try:
        obj = loads_strict(text)
    except ValueError as exc:
        raise invalid(f"Request body is not valid JSON: {exc}.", None) from None
    if not isinstance(obj, dict):
        raise invalid("Request body must be a JSON object.", None)
    return obj


def is_int(value: Any) -> bool:
    """True for a JSON integer (a Python ``int`` that is not a ``bool``)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """True for a finite JSON number (an ``int`` or finite ``float``, never a ``bool``)."""
    if isinstance(value, bool):
        return False
    return is_int(value) or (isinstance(value, float) and math.isfinite(value))


def integer_field(
    body: dict[str, Any], name: str, default: int | None, lo: int, hi: int
) -> int | None:
    """Return ``body[name]``, an integer in ``lo..hi``, or ``default`` when absent or null.

    Raises:
        ApiError: 400 naming ``name`` for another type or a value out of range.
    """
    value = _ranged(body, name, is_int, "an integer", lo, hi, f"{lo}..{hi}")
    return default if value is None else value


def number_field(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    """Return ``body[name]`` as a float in ``lo..hi``, or ``default`` when absent or null.

    Raises:
        ApiError: 400 naming ``name`` for a non-number, an overflowing one, or one out of range.
    """
    value = _ranged(body, name, is_number, "a number", lo, hi, f"{lo:g}..{hi:g}")
    return default if value is None else float(value)


def _ranged(
    body: dict[str, Any],
    name: str,
    fits: Callable[[Any], bool],
    kind: str,
    lo: float,
    hi: float,
    span: str,
) -> Any:
    """Return ``body[name]`` when ``fits`` accepts it and it lies in ``lo..hi`` (``span`` in the
    messages), None when absent or null.

    Raises:
        ApiError: 400 naming ``name``: "must be {kind}" for a value ``fits`` refuses, "must be in
            {span}" for one out of range.
    """
    value = body.get(name)
    if value is None:
        return None
    if not fits(value):
        _refuse_overflow(value, name, f"{kind} in {span}")
        raise invalid(f"'{name}' must be {kind}, got {type(value).__name__}.", name)
    if not lo <= value <= hi:
        raise invalid(f"'{name}' must be in {span}, got {value}.", name)
    return value


def _refuse_overflow(value: Any, name: str, wanted: str) -> None:
    """Name the fault of a JSON number too large for a double (``1e400`` parses to infinity).

    Raises:
        ApiError: 400 naming ``name`` when ``value`` is an infinite float.
    """
    if isinstance(value, float) and math.isinf(value):
        raise invalid(
            f"'{name}' must be {wanted}, got a number too large to represent "
            "(it overflows a 64-bit float).",
            name,
        )


def boolean_field(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(f"'{name}' must be a boolean, got {type(value).__name__}.", name)
    return value


def check_unicode(text: str, name: str) -> None:
    # JSON can carry lone surrogates ("\\ud800") that no UTF-8 answer could echo back.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(f"'{name}' contains a lone surrogate code point.", name) from None


def stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("'stop' must be a string or a list of strings.", "stop")
    if len(stops) > MAX_STOP:
        raise invalid(f"'stop' holds at most {MAX_STOP} strings, got {len(stops)}.", "stop")
    if any(not s for s in stops):
        raise invalid("'stop' strings must not be empty.", "stop")
    for s in stops:
        check_unicode(s, "stop")
    return tuple(stops)


def _logit_bias(value: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise invalid("'logit_bias' must be an object mapping token ids to numbers.", "logit_bias")
    bias: dict[int, float] = {}
    for key, weight in value.items():
        # Canonical decimal only ("1", not "01" or "+1"), checked before int(): no aliases of one id,
        # and no 5000-digit key for int() to choke on.
        canonical = key.isascii() and key.isdigit() and (key == "0" or not key.startswith("0"))
        if not canonical or len(key) > len(str(vocab_size)) or int(key) >= vocab_size:
            raise invalid(
                f"'logit_bias' key {quote_name(key)!r} is not a token id in 0..{vocab_size - 1}.",
                "logit_bias",
            )
        if not is_number(weight) or not -100 <= weight <= 100:
            raise invalid(
                f"'logit_bias' value for {key} must be a number in -100..100.", "logit_bias"
            )
        bias[int(key)] = float(weight)
    return tuple(sorted(bias.items()))


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    value = body.get("stream_options")
    if value is None:
        return False
    if not stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true.", "stream_options")
    if not isinstance(value, dict):
        raise invalid("'stream_options' must be an object.", "stream_options")
    include = value.get("include_usage")
    if include is None:
        return False
    if not isinstance(include, bool):
        raise invalid("'stream_options.include_usage' must be a boolean.", "stream_options")
    return include


def unsupported(name: str, what: str | None = None) -> ApiError:
    """Return the 400 for a documented OpenAI field (or value) this server does not implement."""
    return invalid(f"{what or repr(name)} is not supported by this server.", name)


def part_type(
    part: Any,
    where: str,
    allowed: tuple[str, ...],
    expected: str,
    unsupported_types: frozenset[str] | tuple[str, ...],
    what: str = "Content part",
) -> str:
    """Return the ``type`` of a typed object of a content list (a chat or Responses content part,
    an Anthropic content block), checked: an object, its ``type`` a string (a list or object is
    unhashable: checked before any set lookup), one of ``allowed``.

    Args:
        part: the decoded value.
        where: its path (``messages[2].content[0]``).
        allowed: the types accepted here.
        expected: how the refusal names them (``'text'``, ``one of 'text', 'image'``).
        unsupported_types: documented types this server does not implement (a 400 saying so).
        what: how that refusal names the object (``Content part``, ``Content block``).

    Raises:
        ApiError: 400 naming ``where`` (not an object) or ``where.type``.
    """
    if not isinstance(part, dict):
        raise invalid(f"'{where}' must be an object.", where)
    kind = part.get("type")
    if not isinstance(kind, str):
        raise invalid(f"'{where}.type' is required and must be a string.", f"{where}.type")
    if kind in unsupported_types:
        raise unsupported(f"{where}.type", f"{what} type '{kind}'")
    if kind not in allowed:
        raise invalid(
            f"Invalid value for '{where}.type': {quote_name(kind)!r}; expected {expected}.",
            f"{where}.type",
        )
    return kind


def parse_model(body: dict[str, Any]) -> str:
    """Return the request's ``model``: a non-empty string of at most 256 characters.

    Raises:
        ApiError: 400 with ``param`` ``model``.
    """
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' must be a non-empty string.", "model")
    if len(model) > MAX_MODEL_CHARS:  # echoed in every chunk: bound it
        raise invalid(f"'model' is at most {MAX_MODEL_CHARS} characters.", "model")
    check_unicode(model, "model")
    return model


@dataclass(frozen=True, slots=True)
class SamplingFields:
    """The sampling fields every generation endpoint shares, validated (see the OpenAI defaults)."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    seed: int | None
    n: int


def parse_sampling_fields(body: dict[str, Any], vocab_size: int, max_n: int) -> SamplingFields:
    """Validate ``temperature``, ``top_p``, ``top_k``, ``min_p``, the penalties, ``seed`` and ``n``.

    Raises:
        ApiError: 400 naming the first invalid field, checked in that order.
    """
    return SamplingFields(
        temperature=number_field(body, "temperature", 1.0, 0.0, 2.0),
        top_p=number_field(body, "top_p", 1.0, 0.0, 1.0),
        top_k=integer_field(body, "top_k", 0, -1, vocab_size),
        min_p=number_field(body, "min_p", 0.0, 0.0, 1.0),
        presence_penalty=number_field(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=number_field(body, "frequency_penalty", 0.0, -2.0, 2.0),
        seed=seed_field(body),
        n=integer_field(body, "n", 1, 1, max_n),
    )


def seed_field(body: dict[str, Any]) -> int | None:
    """Return ``seed`` (0..2**64-1), or None when absent or ``null`` (the server picks one).

    A negative seed is a 400, ``-1`` too (llama.cpp's and vLLM's "random"): the contract's seed is
    non-negative, and the message says how to ask for a random one.

    Raises:
        ApiError: 400 with ``param`` ``seed``.

    Source: DESIGN.md §3 and §5, the v0 contract ("``seed`` a non-negative integer").
    """
    value = body.get("seed")
    if is_int(value) and not 0 <= value < SEED_LIMIT:
        raise invalid(
            f"'seed' must be in 0..{SEED_LIMIT - 1}, got {value}; omit 'seed' for a random seed.",
            "seed",
        )
    return integer_field(body, "seed", None, 0, SEED_LIMIT - 1)


@dataclass(frozen=True, slots=True)
class StreamFields:
    """``stream``, ``stream_options.include_usage``, ``ignore_eos`` and ``cache_salt`` ("" when
    absent), validated (``user`` checked)."""

    stream: bool
    include_usage: bool
    ignore_eos: bool
    cache_salt: str = ""


def parse_stream_fields(body: dict[str, Any]) -> StreamFields:
    """Validate ``stream``, ``stream_options``, ``user`` and ``ignore_eos``, in that order.

    Raises:
        ApiError: 400 naming the first invalid field.
    """
    stream = boolean_field(body, "stream")
    include_usage = _stream_options(body, stream)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("'user' must be a string.", "user")
    return StreamFields(stream, include_usage, boolean_field(body, "ignore_eos"), _cache_salt(body))


def _cache_salt(body: dict[str, Any]) -> str:
    """Return ``cache_salt`` (vLLM's extension: only requests with the same salt share cached prompt
    blocks), "" when absent or ``null``.

    Raises:
        ApiError: 400 with ``param`` ``cache_salt`` for a value that is not a non-empty string.

    Source: vLLM OpenAI-compatible server, ``cache_salt``.
    """
    salt = body.get("cache_salt")
    if salt is None:
        return ""
    if not isinstance(salt, str) or not salt:
        raise invalid("'cache_salt' must be a non-empty string if provided.", "cache_salt")
    return salt


def build_sampling(fields: SamplingFields, body: dict[str, Any], vocab_size: int) -> SamplingParams:
    """Return the :class:`SamplingParams` of ``fields`` and the body's ``logit_bias``.

    Raises:
        ApiError: 400 with ``param`` ``logit_bias``.
    """
    return SamplingParams(
        temperature=fields.temperature,
        top_k=max(fields.top_k, 0),  # -1 and 0 both mean "off" (vLLM's convention and ours)
        top_p=fields.top_p,
        min_p=fields.min_p,
        logit_bias=_logit_bias(body.get("logit_bias"), vocab_size),
        presence_penalty=fields.presence_penalty,
        frequency_penalty=fields.frequency_penalty,
    )
