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
