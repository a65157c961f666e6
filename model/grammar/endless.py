"""A JSON Schema without a finite value: every value of it holds a required property or item whose
schema refers back to an enclosing one, so generating it would never end (:func:`endless`).

Read before llguidance compiles a schema (``model.grammar.schema.refusal``): llguidance would
compile such a schema and its generation would run to ``max_tokens``.

Source: JSON Schema 2020-12 Core (§8.2.3 ``$ref``, §10 subschemas) and Validation (``required``,
``minItems``, ``prefixItems``); the productive symbols of a context-free grammar (a least fixed
point).
"""

from __future__ import annotations

from typing import Any

from model.grammar.schema_walk import pointer, ref_target, resolve, subschemas


def _needs(node: dict[str, Any]) -> list[list[Any]] | None:
    """Return what a value of ``node`` must hold, by its ``type``, as alternatives: one list of
    subschemas per type (an object's required properties, an array's first ``minItems`` items),
    each needing a finite value of every subschema in it; None when a value needs none (a scalar
    type allowed, no ``type``, an ``enum`` or ``const``: llguidance allows those values)."""
    if "enum" in node or "const" in node:
        return None
    kinds = node.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if not isinstance(kinds, list) or any(k not in ("object", "array") for k in kinds):
        return None  # a scalar, no type, or one llguidance refuses (its message names it)
    branches: list[list[Any]] = []
    if "object" in kinds:
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = node.get("required") if isinstance(node.get("required"), list) else []
        branches.append([props[n] for n in required if isinstance(n, str) and n in props])
    if "array" in kinds:
        least, items = node.get("minItems", 0), node.get("items", True)
        prefix = node.get("prefixItems")
        if isinstance(items, list):  # the drafts' tuple form
            prefix, items = items, True
        prefix = prefix if isinstance(prefix, list) else []
        least = least if isinstance(least, int) and not isinstance(least, bool) else 0
        # Items past the prefix share one schema: the first of them stands for all.
        first = min(least, len(prefix) + 1)
        branches.append([prefix[i] if i < len(prefix) else items for i in range(first)])
    return branches


def endless(schema: Any) -> str | None:
    """Return why ``schema`` has no finite value, naming where it refers back to itself; None when
    it has one, or cannot tell (a ref to another document: llguidance resolves or refuses it).

    A schema has a finite value when a value of it needs no value of an enclosing schema inside:
    when a scalar is allowed, or its object's required properties (its array's first
    ``minItems`` items) all have one; ``anyOf``/``oneOf`` needs one branch that has, ``allOf``
    every branch, a ``$ref`` its target. This is the least fixed point over the ref targets (the
    productive symbols of a grammar), by a work list: a target is evaluated again only when a
    target it names is found productive. Cost: each subschema's walk, once per target above it.
    """
    users: dict[str, list[str]] = {}  # a ref target -> the targets whose schema names it
    for _, node, _ in subschemas(schema):
        target = ref_target(schema, node.get("$ref"))
        if target is not None:
            users.setdefault(target, [])
    for target in users:
        for _, node, _ in subschemas(resolve(schema, target), target):
            named = ref_target(schema, node.get("$ref"))
            if named is not None and target not in users[named]:
                users[named].append(target)
    productive: set[str] = set()
    work = list(users)
    while work:
        target = work.pop()
        if target not in productive and _finite(schema, resolve(schema, target), productive):
            productive.add(target)
            work += users[target]
    if _finite(schema, schema, productive):
        return None
    return f"can never be satisfied: no value of it is finite ({_cycle(schema, productive)})"


def _finite(root: Any, node: Any, productive: set[str], depth: int = 0) -> bool:
    """Whether ``node`` has a finite value, the ref targets in ``productive`` having one and no
    other. True for what is not known here: past 200 levels of nesting, and for a ``false``
    schema (no value at all: llguidance refuses it, naming the property, when it is needed)."""
    if not isinstance(node, dict) or depth > 200:
        return True
    target = ref_target(root, node.get("$ref"))
    if target is not None and target not in productive:
        return False
    for key, need in (("allOf", all), ("anyOf", any), ("oneOf", any)):
        if isinstance(node.get(key), list) and not need(
            _finite(root, s, productive, depth + 1) for s in node[key]
        ):
            return False
    branches = _needs(node)
    return branches is None or any(
        all(_finite(root, s, productive, depth + 1) for s in branch) for branch in branches
    )


def _cycle(root: Any, productive: set[str]) -> str:
    """Say where a schema with no finite value needs one of its own: going down its parts that
    have none, the ref that leads back to a schema already on the way."""
    node, at, seen = root, "#", {"#"}
    while isinstance(node, dict):
        target = ref_target(root, node.get("$ref"))
        if target is not None and target not in productive:
            if target in seen:
                return f"every value holds one at {at}, which refers back to {target}"
            seen.add(target)
            node, at = resolve(root, target), target
            continue
        part = _failing_part(root, node, at, productive)
        if part is None:
            break
        at, node = part
    return f"every value holds one at {at}, which has none"


def _failing_part(root: Any, node: dict[str, Any], at: str, productive: set[str]) -> Any:
    """Return ``(pointer, subschema)`` of a part of ``node`` without a finite value that a value of
    ``node`` needs (an ``allOf`` branch, an ``anyOf``/``oneOf`` one, a required property or
    item), or None."""
    parts: list[tuple[str, Any]] = []
    for key in ("allOf", "prefixItems"):
        if isinstance(node.get(key), list):
            parts += [(pointer(pointer(at, key), i), s) for i, s in enumerate(node[key])]
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    parts += [(pointer(pointer(at, "properties"), n), props[n]) for n in required if n in props]
    if isinstance(node.get("items"), dict):
        parts.append((pointer(at, "items"), node["items"]))
    for key in ("anyOf", "oneOf"):  # a value needs one of them: the first stands for all
        if isinstance(node.get(key), list) and node[key]:
            parts.append((pointer(pointer(at, key), 0), node[key][0]))
    return next((p for p in parts if not _finite(root, p[1], productive)), None)
