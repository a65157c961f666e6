"""Tool-call formats: one class per syntax a model writes its calls in, and the registry that picks
a model's.

Each format (``base.ToolFormat``) holds its grammar (what a call may be), its reader of generated
text (``CallParser``), its streaming hold-back (``open_tag``) and its name in the tool template
(``model/templates/tools.jinja``, how the prompt shows tools and calls to a chat template that does
not render them). The registry:

- :data:`FORMATS`: the formats' names (``smollm2``, ``hermes``), what ``TOOL_CALL_FORMAT`` and the
  tool template's ``tool_call_format`` name; :data:`DEFAULT` is SmolLM2-Instruct's.
- :func:`tool_format`: a name to its format.
- :func:`format_of_rendered`: the format a chat template that renders tools itself writes its calls
  in, read from its render of :data:`SAMPLE_CALL` (``ChatTemplate.tool_format``): a model picks its
  format by its own template; a template that does not render tools gets the tool template's.

Source: docs/ARCHITECTURE.md §14 (tool calls).
"""

from __future__ import annotations

import re

from model.tool_formats.base import OPEN, CallParser, FunctionSpec, ParsedCall, ToolFormat
from model.tool_formats.hermes import HERMES, QWEN_HERMES, HermesFormat
from model.tool_formats.smollm2 import SMOLLM2, SmolLM2Format

__all__ = [
    "DEFAULT",
    "FORMATS",
    "SAMPLE_CALL",
    "SAMPLE_TOOLS",
    "CallParser",
    "FunctionSpec",
    "HermesFormat",
    "ParsedCall",
    "SmolLM2Format",
    "ToolFormat",
    "format_of_rendered",
    "tool_format",
]

_BY_NAME: dict[str, ToolFormat] = {SMOLLM2.name: SMOLLM2, HERMES.name: HERMES}
FORMATS = tuple(_BY_NAME)
DEFAULT = SMOLLM2.name

# A tool and a conversation calling it: what a template that renders tools shows its format with.
SAMPLE_TOOLS = (
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
)
SAMPLE_CALL = (
    {"role": "user", "content": "The weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C"},
)


def tool_format(name: str) -> ToolFormat:
    """Return the format named ``name`` (one of :data:`FORMATS`).

    Raises:
        ValueError: no format has that name.
    """
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"tool_call_format must be one of {', '.join(FORMATS)}, got {name!r}"
        ) from None


# The sample's call as a template writes it: its JSON object, spaced any way, name first.
_SAMPLE_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"get_weather"')


def format_of_rendered(text: str) -> ToolFormat | None:
    """Return the format a template writes :data:`SAMPLE_CALL`'s call in, or None when it writes
    it in no format known here. Only the tag before that call counts: a system prompt that shows
    the format (``<tool_call>\\n{"name": <function-name>, ...``) names no function of the sample.

    Args:
        text: a chat template's render of :data:`SAMPLE_CALL` with :data:`SAMPLE_TOOLS`.
    """
    at = text.find(OPEN)
    while at >= 0:
        after = text[at + len(OPEN) :]
        for prefix, fmt in (("[", SMOLLM2), ("\n", QWEN_HERMES), ("", HERMES)):
            if after.startswith(prefix) and _SAMPLE_CALL_HEAD.match(after, len(prefix)):
                return fmt
        at = text.find(OPEN, at + 1)
    return None
