"""The naming keys of a JSON Schema's wrapper: ``name``, ``description``, ``strict`` (no Flask here).

OpenAI wraps a schema in the same keys in two places: ``response_format.json_schema`` and a tool's
``function``; :func:`described_object` checks them once for both.

Source: OpenAI API reference, "Chat Completions" (``response_format``, ``tools``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from wsgi_app.api.errors import invalid, quote_name

# OpenAI's rule for a function's or a schema's name.
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True, slots=True)
class Described:
    """The naming keys of a schema's wrapper (:func:`described_object`).

    Attributes:
        name: the ``name``, or None when absent.
        description: the ``description``, or None when absent.
        strict: the ``strict`` flag, or None when absent.
    """

    name: str | None
    description: str | None
    strict: bool | None


def described_object(
    value: dict[str, Any], where: str, keys: tuple[str, ...], *, name_required: bool
) -> Described:
    """Check an object that names and describes a JSON Schema: OpenAI's
    ``response_format.json_schema`` and a tool's ``function`` (``name``, ``description``,
    ``strict`` and the schema's own key).

    Args:
        value: the object.
        where: its path in the body (``response_format.json_schema``, ``tools[2].function``).
        keys: the keys it may hold.
        name_required: a missing ``name`` is refused (a function's) or allowed (a schema's).

    Raises:
        ApiError: 400 naming ``<where>.<key>``: a key not in ``keys``; a ``name`` that is not 1..64
            characters of a-z, A-Z, 0-9, '_' and '-'; a ``description`` that is not a string; a
            ``strict`` that is not a boolean.

    Source: OpenAI API reference, "Chat Completions" (``response_format``, ``tools``).
    """
    for key in value:
        if key not in keys:
            at = f"{where}.{quote_name(key)}"
            raise invalid(f"Unrecognized request argument supplied: {at}", at)
    name = value.get("name")
    if (name is not None or name_required) and (
        not isinstance(name, str) or not NAME_PATTERN.fullmatch(name)
    ):
        raise invalid(
            f"'{where}.name' must be 1..64 characters of a-z, A-Z, 0-9, '_' and '-'.",
            f"{where}.name",
        )
    description = value.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid(f"'{where}.description' must be a string.", f"{where}.description")
    strict = value.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid(f"'{where}.strict' must be a boolean.", f"{where}.strict")
    return Described(name, description, strict)
