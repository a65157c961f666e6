"""Walking a JSON Schema: the JSON pointers of its subschemas and of its local ``$ref`` targets.

Shared by the checks made before llguidance compiles a schema (``model.grammar.schema``) and the
search for a schema without a finite value (``model.grammar.endless``).

Source: JSON Schema 2020-12 Core (§8.2.3 ``$ref``, §10 subschemas); RFC 6901 (JSON Pointer).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = (
    "items additionalProperties not if then else contains propertyNames unevaluatedProperties "
    "unevaluatedItems additionalItems".split()
)
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def pointer(where: str, key: str | int) -> str:
    """Return the JSON pointer ``where`` extended by ``key`` (``~`` and ``/`` escaped, RFC 6901)."""
    return f"{where}/{str(key).replace('~', '~0').replace('/', '~1')}"


def subschemas(
    schema: Any, where: str = "#", skip: frozenset[str] = frozenset()
) -> Iterator[tuple[str, dict[str, Any], str | None]]:
    """Yield ``(JSON pointer, subschema, keyword)`` for ``schema`` and every subschema in it, parents
    first; ``keyword`` is the one the subschema sits under (``allOf``, ``properties``...), None for
    the root. Boolean subschemas are skipped, and so are values that are data (``enum``, ``const``,
    ``default``...) and property names, and the subschemas under a keyword of ``skip``. Iterative:
    a schema nested as deep as JSON goes is read. A subschema's children are found when the next
    one is asked for, so a caller may remove keys of the one yielded and its walk skips them.

    Source: JSON Schema 2020-12 Core §10 (where subschemas sit), and the drafts' ``definitions``,
    ``dependencies`` and array ``items``.
    """
    stack: list[tuple[str, Any, str | None]] = [(where, schema, None)]
    while stack:
        at, node, keyword = stack.pop()
        if not isinstance(node, dict):
            continue
        yield at, node, keyword
        found = []
        for key, value in node.items():
            if key in skip:
                continue
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                found += [(pointer(pointer(at, key), k), v, key) for k, v in value.items()]
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                found += [(pointer(pointer(at, key), i), v, key) for i, v in enumerate(value)]
            elif key in _SCHEMA_ONE:
                found.append((pointer(at, key), value, key))
        stack.extend(reversed(found))


def ref_tokens(ref: str) -> list[str]:
    """Return the reference tokens of the local JSON pointer ``ref`` (``#/a/b``), unescaped."""
    return [unquote(t).replace("~1", "/").replace("~0", "~") for t in ref[1:].split("/")[1:]]


def ref_target(schema: Any, ref: Any) -> str | None:
    """Return the JSON pointer ``ref`` names in ``schema``, as :func:`subschemas` spells it (``#``,
    ``#/$defs/a``), or None when it is not a local pointer to something there (another document,
    an anchor, a missing key: llguidance refuses or resolves those itself)."""
    if not isinstance(ref, str) or not ref.startswith("#") or ref[1:2] not in ("", "/"):
        return None
    node, at = schema, "#"
    for token in ref_tokens(ref):
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
        at = pointer(at, token)
    return at


def resolve(schema: Any, target: str) -> Any:
    """Return the value at ``target``, a pointer :func:`ref_target` returned."""
    node = schema
    for token in ref_tokens(target):
        node = node[int(token)] if isinstance(node, list) else node[token]
    return node
