"""JSON Schemas of the kinds applications send, small enough that a byte-level model finishes them
within 48 tokens (each string is bounded: the bigram's greedy text inside a string is spaces)."""

from __future__ import annotations

OBJ = {"type": "object", "additionalProperties": False}


def obj(props: dict, required: list[str] | None = None, **extra) -> dict:
    """An object schema with ``props``, all required unless ``required`` says otherwise."""
    return {
        **OBJ,
        "properties": props,
        "required": list(props) if required is None else required,
        **extra,
    }


SHORT = {"type": "string", "maxLength": 4}

SCHEMAS: dict[str, dict] = {
    "integer": obj({"a": {"type": "integer"}}),
    "boolean": obj({"ok": {"type": "boolean"}}),
    "enum": obj({"c": {"enum": ["red", "green", "blue"]}}),
    "const": obj({"v": {"const": "x1"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}}),
    "number_bounds": obj({"p": {"type": "number", "minimum": 0, "maximum": 1}}),
    "integer_bounds": obj({"age": {"type": "integer", "minimum": 18, "maximum": 99}}),
    "exclusive_bounds": obj(
        {"t": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5}}
    ),
    "negative": obj({"d": {"type": "integer", "minimum": -50, "maximum": -10}}),
    "short_string": obj({"s": SHORT}),
    "min_max_length": obj({"s": {"type": "string", "minLength": 2, "maxLength": 3}}),
    "pattern": obj({"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}}),
    "pattern_digits": obj({"zip": {"type": "string", "pattern": "^\\d{3}$"}}),
    "array_bounds": obj(
        {
            "xs": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 1,
                "maxItems": 3,
            }
        }
    ),
    "array_enum": obj({"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}),
    "array_exact": obj(
        {
            "xy": {
                "type": "array",
                "items": {"type": "integer", "maximum": 99, "minimum": 0},
                "minItems": 2,
                "maxItems": 2,
            }
        }
    ),
    "nested": obj({"p": obj({"x": {"type": "integer", "maximum": 9, "minimum": 0}})}),
    "nested_two": obj({"o": obj({"i": obj({"b": {"type": "boolean"}})})}),
    "any_of_scalar": obj(
        {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]}}
    ),
    "any_of_objects": {"anyOf": [obj({"k": {"const": 1}}), obj({"j": {"type": "boolean"}})]},
    "defs_ref": {
        "$defs": {"pt": obj({"x": {"type": "integer", "minimum": 0, "maximum": 9}})},
        **obj({"a": {"$ref": "#/$defs/pt"}}),
    },
    "recursive_ref": {
        "$defs": {
            "n": obj(
                {
                    "v": {"type": "integer", "minimum": 0, "maximum": 9},
                    "k": {"type": "array", "items": {"$ref": "#/$defs/n"}, "maxItems": 1},
                },
                ["v"],
            )
        },
        "$ref": "#/$defs/n",
    },
    "required_subset": obj(
        {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": SHORT}, ["a"]
    ),
    "optional_only": obj({"a": {"type": "boolean"}, "b": {"type": "boolean"}}, []),
    "null": obj({"z": {"type": "null"}}),
    "nullable": obj({"m": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}),
    "top_array": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    "top_enum": {"enum": ["yes", "no", "maybe"]},
    "top_integer": {"type": "integer", "minimum": 100, "maximum": 999},
    "top_boolean": {"type": "boolean"},
    "nested_arrays": obj(
        {
            "m": {
                "type": "array",
                "items": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "maxItems": 2,
                },
                "maxItems": 2,
            }
        }
    ),
    "const_object": obj({"cfg": {"const": {"on": True}}}),
    "one_of_disjoint": obj(
        {"u": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]}}
    ),
    "tuple": obj(
        {
            "t": {
                "type": "array",
                "prefixItems": [
                    {"type": "integer", "minimum": 0, "maximum": 9},
                    {"type": "boolean"},
                ],
                "items": False,
            }
        }
    ),
    "enum_and_bounds": obj(
        {"u": {"enum": ["kg", "lb"]}, "w": {"type": "integer", "minimum": 1, "maximum": 500}}
    ),
    "date": obj({"d": {"type": "string", "format": "date"}}),
}

# Valid JSON Schemas that no value satisfies, each with the reason its refusal gives (after
# "'<param>' cannot be enforced: "): llguidance's own, found when it compiles the schema, or (the
# endless ones) found before, by model.grammar.endless.endless: every value would hold one of its
# own inside, without end.
_NODE = {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"]}
NO_VALUE = (
    "can never be satisfied: no value of it is finite (every value holds one at {}, which refers "
    "back to {})"
)
# Satisfiable as far as a grammar's forced start can tell (`{"a":`, then a choice), none once "a"
# is written: "b" must follow, an endless object. Found by the static analysis all the same.
ENDLESS_AFTER_A_CHOICE = {
    **obj({"a": {"type": "boolean"}, "b": {"$ref": "#/$defs/node"}}),
    "$defs": {"node": _NODE},
}
ENDLESS: dict[str, tuple[dict, str]] = {
    "endless-object": (
        {"$defs": {"node": _NODE}, "$ref": "#/$defs/node"},
        NO_VALUE.format("#/$defs/node/properties/next", "#/$defs/node"),
    ),
    "endless-array": (
        {
            "$defs": {"list": {"type": "array", "items": {"$ref": "#/$defs/list"}, "minItems": 1}},
            "$ref": "#/$defs/list",
        },
        NO_VALUE.format("#/$defs/list/items", "#/$defs/list"),
    ),
    "after-a-choice": (
        ENDLESS_AFTER_A_CHOICE,
        NO_VALUE.format("#/$defs/node/properties/next", "#/$defs/node"),
    ),
    # A choice at every level: {"x":1,"a":{"x":2,"a":{...}}} never ends, never leaves its mask empty.
    "enum-then-itself": (
        obj({"x": {"enum": [1, 2]}, "a": {"$ref": "#"}}),
        NO_VALUE.format("#/properties/a", "#"),
    ),
    "optional-beside-itself": (
        obj({"b": {"type": "integer"}, "a": {"$ref": "#"}}, ["a"]),
        NO_VALUE.format("#/properties/a", "#"),
    ),
    "each-other": (
        {
            "$defs": {
                "p": obj({"q": {"$ref": "#/$defs/q"}}),
                "q": {"anyOf": [obj({"p": {"$ref": "#/$defs/p"}}), {"$ref": "#/$defs/p"}]},
            },
            "$ref": "#/$defs/p",
        },
        NO_VALUE.format("#/$defs/q/anyOf/0/properties/p", "#/$defs/p"),
    ),
}
UNSATISFIABLE: dict[str, tuple[dict, str]] = {
    "string-lengths": (
        {"type": "string", "minLength": 5, "maxLength": 2},
        "Unsatisfiable schema: minLength (5) is greater than maxLength (2)",
    ),
    "integer-bounds": (
        {"type": "integer", "minimum": 5, "maximum": 2},
        "Unsatisfiable schema: minimum (5) is greater than maximum (2)",
    ),
    "array-lengths": (
        {"type": "array", "minItems": 3, "maxItems": 1},
        "Unsatisfiable schema: minItems (3) is greater than maxItems (1)",
    ),
    "empty-enum": ({"enum": []}, "Unsatisfiable schema: anyOf is empty"),
    "required-forbidden": (
        obj({"a": {"type": "string"}}, required=["b"]),
        "Unsatisfiable schema: required property 'b' is unsatisfiable",
    ),
    "required-unsatisfiable": (
        obj({"a": {"type": "integer", "minimum": 5, "maximum": 2}}),
        "Unsatisfiable schema: required property 'a' is unsatisfiable",
    ),
    **ENDLESS,
}
# Recursive schemas with finite values: a tree whose kids may be empty, a list that may end with
# null, two schemas that refer to each other with a way out.
RECURSIVE_WITH_AN_END: dict[str, dict] = {
    "tree": obj({"kids": {"type": "array", "items": {"$ref": "#"}}}),
    "nullable-tail": obj(
        {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}
    ),
    "optional-self": obj({"v": {"type": "boolean"}, "a": {"$ref": "#"}}, ["v"]),
    "each-other-with-an-end": {
        "$defs": {
            "p": obj({"q": {"$ref": "#/$defs/q"}}),
            "q": {"anyOf": [obj({"p": {"$ref": "#/$defs/p"}}), {"type": "boolean"}]},
        },
        "$ref": "#/$defs/p",
    },
}
