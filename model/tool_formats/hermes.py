"""The Hermes tool-call format (Qwen2.5's and NousResearch Hermes' chat templates): one JSON object
per ``<tool_call>`` block, blocks one after another.

Qwen2.5's template writes ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``, a newline
inside the tags and between blocks; greenserve's own tool template asks for the same, while its
grammar (``TOOL_CALL_FORMAT=hermes`` under a template that does not render tools) writes the blocks
without newlines. :class:`HermesFormat` is either, by its ``pad``: a model whose own template renders
tools gets the layout that template writes (``model.tool_formats.format_of_rendered``).

Source: the Hermes function-calling format (NousResearch/Hermes-Function-Calling); Qwen2.5-Instruct's
chat template.
"""

from __future__ import annotations

from model.tool_formats.base import CLOSE, OPEN, ToolFormat, literal


class HermesFormat(ToolFormat):
    """A ``<tool_call>`` block per call.

    Args:
        pad: the text inside each tag's side of the call and between two blocks: ``""`` or
            ``"\\n"`` (Qwen2.5's layout).
    """

    name = "hermes"
    separator = None

    def __init__(self, pad: str = "") -> None:
        self.pad = pad
        self.opening = OPEN + pad
        self.closing = pad + CLOSE
        self.reopening = pad + OPEN + pad

    def rest_rules(self, parallel: bool) -> list[str]:
        """Return the rules of the blocks after the first opening tag: a call and its closing tag,
        then (``parallel``) more whole blocks."""
        first = f"{literal(self.pad)} call" if self.pad else "call"
        return [
            f"rest: {first} {literal(self.closing)}" + (" block*" if parallel else ""),
            f"block: {literal(self.reopening)} call {literal(self.closing)}",
        ]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HermesFormat) and other.pad == self.pad

    def __hash__(self) -> int:
        return hash((self.name, self.pad))

    def __repr__(self) -> str:
        return f"<tool format hermes pad={self.pad!r}>"


HERMES = HermesFormat()
QWEN_HERMES = HermesFormat("\n")
