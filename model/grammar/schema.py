"""JSON Schemas read before llguidance compiles them: what it would skip, misread or loop on.

llguidance compiles a schema into a grammar and refuses what it cannot enforce, but some faults it
cannot see or reports in its own terms; :func:`refusal` finds them first, each with the JSON pointer
of the part at fault:

- a key that is no keyword enforced here (``maxLenght``; llguidance would skip it);
- an integer beyond llguidance's ``i64``/``u64`` values (its bindings cannot read one), and a bound
  or constant at or below -2^63 (its integer ranges overflow there, and can crash the process);
- a ``pattern`` or ``patternProperties`` key that is not an ECMA-262 regular expression, read as
  JSON Schema says (the ``u`` flag; identity escapes of ASCII punctuation such as ``\\-`` allowed as
  in plain ECMA-262): llguidance reads patterns in Rust's regex syntax, which takes ``(?P<x>a)`` and
  reads ``\\z`` otherwise;
- a keyword llguidance does not implement (:data:`UNIMPLEMENTED`: ``propertyNames``, ``if``...),
  named by its pointer (llguidance's own message names no place);
- a schema with no finite value (``model.grammar.endless.endless``): every value of it holds a
  required property or item whose schema refers back to an enclosing one; it would never end.

:func:`without_unimplemented` leaves those keywords out instead, saying where each was: what a tool
that is not strict is enforced by (``wsgi_app.api.tools``), every other constraint of the schema kept.

:func:`closed` closes the object schemas that do not say ``additionalProperties`` (llama.cpp's and
vLLM's reading; :func:`arguments_schema` for a tool's ``parameters``), and :func:`open_object`
finds one that says it is open (refused under OpenAI's strict mode).

Source: JSON Schema 2020-12 Core (§6.4 regular expressions, §8.2.3 ``$ref``, §10 subschemas) and
Validation; ECMA-262 §22.2 (RegExp pattern syntax) via the ``regress`` package; llguidance
docs/json_schema.md; llama.cpp ``json_schema_to_grammar``; vLLM ``process_for_additional_properties``.
"""

from __future__ import annotations

import json
import string
from collections.abc import Iterator
from typing import Any

import regress

from model.grammar.endless import endless
from model.grammar.schema_walk import pointer, ref_target, subschemas

# JSON Schema keywords a schema may use: what llguidance enforces, the annotations that constrain
# nothing, and the ones llguidance itself refuses (so that its message names them). Any other key is
# refused, so that a typo ("maxLenght") or a keyword llguidance would skip is never silently dropped.
ENFORCED = frozenset(
    "type properties required additionalProperties items prefixItems minItems maxItems enum const "
    "anyOf oneOf allOf $ref $defs definitions pattern format minLength maxLength minimum maximum "
    "exclusiveMinimum exclusiveMaximum multipleOf patternProperties minProperties maxProperties "
    "x-guidance".split()
)
ANNOTATIONS = frozenset(
    "title description $schema $id $comment $anchor examples default deprecated readOnly "
    "writeOnly".split()
)
REFUSED_BY_LLGUIDANCE = frozenset(
    "uniqueItems if then else not contains minContains maxContains propertyNames "
    "dependentRequired dependentSchemas dependencies unevaluatedProperties unevaluatedItems "
    "additionalItems".split()
)
# What llguidance 1.9 answers "Unimplemented keys" for (checked against it by tests/test_lenient_tools.py);
# ``additionalItems`` of REFUSED_BY_LLGUIDANCE is not among them: llguidance enforces it.
UNIMPLEMENTED = frozenset(
    "uniqueItems if then else not contains minContains maxContains propertyNames "
    "dependentRequired dependentSchemas dependencies unevaluatedProperties unevaluatedItems".split()
)
# The integers llguidance's bindings read (serde_json's i64 and u64), and the double at or below
# which its integer bounds saturate (bad_number).
INT_RANGE = (-(2**63), 2**64 - 1)
_LOWEST = -(2.0**63)
_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
# Identity escapes that the u flag refuses and plain ECMA-262 reads as the character, as llguidance
# does: ASCII punctuation but the syntax characters (allowed escaped either way) and < > (word
# boundaries in Rust's syntax, so refused rather than read two ways).
_PUNCTUATION = frozenset(string.punctuation + " ") - set("^$\\.*+?()[]{}|/<>")


def refusal(schema: Any) -> str | None:
    """Return why ``schema`` cannot be enforced as written, before llguidance reads it (see the
    module docstring), or None. The reason names the part at fault by its JSON pointer."""
    unknown = unknown_keyword(schema)
    if unknown is not None:
        return f"uses {unknown}, which is not a JSON Schema keyword enforced here"
    found = unimplemented(schema)
    if found:
        *path, key = found[0]
        at = "#" + "".join(pointer("", p) for p in path)
        return (
            f"uses {key!r} at {at}, a JSON Schema keyword llguidance does not implement "
            "(only the schema of a tool that is not strict is enforced without it)"
        )
    return bad_number(schema) or bad_pattern(schema) or endless(schema)


def unknown_keyword(schema: Any, where: str = "#") -> str | None:
    """Return ``'name' at <JSON pointer>`` for the first key of ``schema`` (or a subschema) that is
    not a keyword of :data:`ENFORCED`, :data:`ANNOTATIONS` or :data:`REFUSED_BY_LLGUIDANCE`; None
    when there is none.

    Source: JSON Schema 2020-12 Core and Validation (the keywords and where subschemas sit).
    """
    for at, node, _ in subschemas(schema, where):
        for key in node:
            if key not in ENFORCED and key not in ANNOTATIONS and key not in REFUSED_BY_LLGUIDANCE:
                return f"{key!r} at {at}"
    return None


def unimplemented(schema: Any) -> list[list[str | int]]:
    """Return where ``schema`` uses a keyword of :data:`UNIMPLEMENTED`: for each, the keys and
    indices from the root to it, the keyword last (``["properties", "todos", "propertyNames"]``),
    parents first. One inside another's subschema (a ``not`` in an ``if``) is not listed: it goes
    with that one. A property named like a keyword is a name, not a keyword (:func:`subschemas`).
    """
    return [
        [*_parts(schema, at), key]
        for at, node, _ in subschemas(schema, skip=UNIMPLEMENTED)
        for key in node
        if key in UNIMPLEMENTED
    ]


def without_unimplemented(schema: Any) -> tuple[Any, list[list[str | int]]]:
    """Return ``schema`` without the keywords llguidance does not implement (a copy when it had
    any; ``schema`` is unchanged), and where they were (:func:`unimplemented`). What is left
    allows every value ``schema`` allows, and is enforced whole.

    Source: llguidance docs/json_schema.md (the keywords it enforces); JSON Schema 2020-12 Core §10.
    """
    dropped = unimplemented(schema)
    if not dropped:
        return schema, []
    copy = _copy(schema)
    for _, node, _ in subschemas(copy, skip=UNIMPLEMENTED):
        for key in UNIMPLEMENTED.intersection(node):
            del node[key]
    return copy, dropped


def _parts(schema: Any, at: str) -> list[str | int]:
    """Return the keys and indices (ints) of ``at``, a JSON pointer :func:`subschemas` yielded for
    ``schema``: unescaped as RFC 6901 says (its pointers are not percent-encoded)."""
    node, parts = schema, []
    for token in at.split("/")[1:]:
        part: str | int = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, list):
            part = int(part)
        node = node[part]
        parts.append(part)
    return parts


def bad_number(schema: Any) -> str | None:
    """Return why a number of ``schema`` is one llguidance cannot take, naming its pointer; None
    when there is none.

    Two kinds: an integer anywhere (data and annotations too) outside :data:`INT_RANGE`, which its
    bindings cannot read; and a bound (``minimum``, ``maximum`` and their exclusive forms) or a
    ``const``/``enum`` number at or below -2^63 as a double, where llguidance's integer range
    saturates to ``i64::MIN`` and, both ends there, recurses without end and crashes the process
    (llguidance parser/src/json/numeric.rs ``rx_int_range``: ``-left`` overflows).
    """
    low, high = INT_RANGE
    for at, value in _numbers(schema, "#"):
        if isinstance(value, int) and not low <= value <= high:
            return f"the integer at {at} is outside the range llguidance reads (-2^63 to 2^64-1)"
    for at, node, _ in subschemas(schema):
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "const", "enum"):
            for where, value in _numbers(node.get(key), pointer(at, key)):
                if float(value) <= _LOWEST:
                    return (
                        f"the number at {where} is at or below -2^63, where llguidance's integer "
                        "ranges overflow"
                    )
    return None


def _numbers(value: Any, where: str) -> Iterator[tuple[str, int | float]]:
    """Yield ``(JSON pointer, number)`` for every number in the JSON ``value`` (booleans aside)."""
    stack = [(where, value)]
    while stack:
        at, node = stack.pop()
        if isinstance(node, dict):
            stack += [(pointer(at, k), v) for k, v in node.items()]
        elif isinstance(node, list):
            stack += [(pointer(at, i), v) for i, v in enumerate(node)]
        elif isinstance(node, int | float) and not isinstance(node, bool):
            yield at, node


def ecma_error(pattern: str) -> str | None:
    """Return why ``pattern`` is not an ECMA-262 regular expression as JSON Schema reads it (the
    ``u`` flag, with identity escapes of ASCII punctuation allowed: :data:`_PUNCTUATION`), or None.

    Source: ECMA-262 §22.2.1 (Patterns), JSON Schema 2020-12 Core §6.4.
    """
    out, i = [], 0
    while i < len(pattern):
        if pattern[i] == "\\" and i + 1 < len(pattern):
            escaped = pattern[i + 1]
            out.append(f"\\x{ord(escaped):02X}" if escaped in _PUNCTUATION else pattern[i : i + 2])
            i += 2
        else:
            out.append(pattern[i])
            i += 1
    try:
        regress.Regex("".join(out), "u")
    except regress.RegressError as exc:
        return str(exc)
    return None


def rust_reading(pattern: str) -> str | None:
    """Return why ``pattern``, valid ECMA-262, would mean something else to llguidance, which reads
    patterns in Rust's regex syntax, or None: a character class holding ``&&``, ``--`` or ``~~``
    (set operations in Rust, the characters themselves in ECMA-262), an unescaped ``[`` (a nested
    class in Rust) or starting with ``]`` (``[]`` is an empty class in ECMA-262, ``]`` in Rust).

    Source: ECMA-262 §22.2.1 (``ClassContents`` without the ``v`` flag); the regex crate's syntax
    ("Character classes": nesting and set operations).
    """
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c != "[":
            i += 1
            continue
        i += 1
        if pattern.startswith("^]", i):
            return "'[^]', any character in ECMA-262 (write [\\s\\S])"
        if pattern.startswith("^", i):
            i += 1
        if pattern.startswith("]", i):
            return "a class starting with ']' (escape it as \\])"
        while i < n and pattern[i] != "]":
            if pattern[i] == "\\":
                i += 2
                continue
            if pattern[i] == "[":
                return "a '[' inside a class (escape it as \\[)"
            pair = pattern[i : i + 2]
            if pair in ("&&", "--", "~~"):
                return f"{pair!r} inside a class, a set operation there (escape one: \\{pair[0]})"
            i += 1
        i += 1
    return None


def bad_pattern(schema: Any) -> str | None:
    """Return why the first ``pattern`` or ``patternProperties`` key of ``schema`` that is not
    ECMA-262 (:func:`ecma_error`), or that llguidance would read otherwise (:func:`rust_reading`),
    is refused, naming it and its pointer; None when all are good."""
    for at, node, _ in subschemas(schema):
        found = []
        if isinstance(node.get("pattern"), str):
            found.append((node["pattern"], f"'pattern' at {at}"))
        if isinstance(node.get("patternProperties"), dict):
            found += [(k, f"'patternProperties' key at {at}") for k in node["patternProperties"]]
        for pattern, what in found:
            why = ecma_error(pattern)
            if why is not None:
                return (
                    f"the {what}, {pattern!r}, is not an ECMA-262 regular expression ({why}); "
                    "JSON Schema patterns are ECMA-262 with the u flag"
                )
            why = rust_reading(pattern)
            if why is not None:
                return (
                    f"the {what}, {pattern!r}, holds {why}: llguidance reads patterns in Rust's "
                    "regex syntax, where it means something else than in ECMA-262"
                )
    return None


def closed(schema: Any, limit_bytes: int | None = None) -> Any:
    """Return a copy of ``schema`` whose object schemas (those with ``properties`` or
    ``patternProperties``) that do not say ``additionalProperties`` say ``false``, as llama.cpp
    reads every schema and vLLM's ``disable_additional_properties`` asks; ``schema`` is unchanged.

    The parts of a merge are left as they are: two or more of a schema's ``allOf`` branches, its
    ``$ref`` and its own properties (and the ref targets among them). JSON Schema, and llguidance,
    read ``additionalProperties`` against the properties beside it only, so closing one part would
    forbid the others' properties. A lone ``allOf`` branch or a ``$ref`` with only annotations
    beside it (pydantic writes both) is no merge.

    A schema whose compact JSON is over ``limit_bytes`` is returned as it is: it is refused for its
    size, and closing it (a walk in Python, ~0.5 µs a byte, where the request is read) would only
    cost time.

    Source: llama.cpp ``json_schema_to_grammar`` (an object with properties is closed unless
    ``additionalProperties`` says otherwise); vLLM ``process_for_additional_properties``.
    """
    if limit_bytes is not None and len(_COMPACT.encode(schema)) > limit_bytes:
        return schema
    copy = _copy(schema)
    merged: set[str | None] = set()
    for at, node, _ in subschemas(copy):
        parts: list[tuple[str | None, Any]] = []
        if isinstance(node.get("allOf"), list):
            parts += [(pointer(pointer(at, "allOf"), i), s) for i, s in enumerate(node["allOf"])]
        if "$ref" in node:
            parts.append((None, node))
        if "properties" in node or "patternProperties" in node:
            parts.append((at, node))
        if len(parts) > 1:
            for where, part in parts:
                merged.add(where)
                if isinstance(part, dict):
                    merged.add(ref_target(copy, part.get("$ref")))
    for at, node, _ in subschemas(copy):
        if (
            ("properties" in node or "patternProperties" in node)
            and "additionalProperties" not in node
            and at not in merged
        ):
            node["additionalProperties"] = False
    return copy


def arguments_schema(parameters: dict[str, Any], limit_bytes: int | None = None) -> dict[str, Any]:
    """Return the schema a tool call's arguments are enforced by: its ``parameters`` with objects
    :func:`closed` (``limit_bytes`` as there), and ``"type": "object"`` at the root when it has no
    ``type`` (arguments are always an object, as OpenAI reads every function's parameters).

    Source: OpenAI "Function calling" guide (parameters: a JSON Schema object); llama.cpp
    ``json_schema_to_grammar``.
    """
    enforced = closed(parameters, limit_bytes)
    return enforced if "type" in enforced else {**enforced, "type": "object"}


def open_object(schema: Any) -> str | None:
    """Return the JSON pointer of the first object schema of ``schema`` whose
    ``additionalProperties`` is not ``false`` (true, or a schema), or None."""
    for at, node, _ in subschemas(schema):
        if node.get("additionalProperties", False) is not False:
            return at
    return None


def _copy(value: Any) -> Any:
    """Return a deep copy of the JSON ``value`` (dicts, lists, scalars), iteratively."""
    holder: list[Any] = [None]
    stack: list[tuple[Any, Any, Any]] = [(value, holder, 0)]
    while stack:
        node, parent, key = stack.pop()
        if isinstance(node, dict):
            parent[key] = dict.fromkeys(node)
            stack += [(v, parent[key], k) for k, v in node.items()]
        elif isinstance(node, list):
            parent[key] = [None] * len(node)
            stack += [(v, parent[key], i) for i, v in enumerate(node)]
        else:
            parent[key] = node
    return holder[0]
