"""SmolLM2-Instruct's tool-call format: one ``<tool_call>`` block holding a JSON array of calls,
``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>``.

Source: Ollama's ``smollm2`` template (SmolLM2-Instruct's trained tool-call format).
"""

from __future__ import annotations

from model.tool_formats.base import CLOSE, OPEN, ToolFormat, literal


class SmolLM2Format(ToolFormat):
    """One block, its calls a JSON array (``parallel``: comma-separated; else exactly one)."""

    name = "smollm2"
    opening = OPEN + "["
    separator = ","
    closing = "]" + CLOSE

    def rest_rules(self, parallel: bool) -> list[str]:
        """Return the rule of the block after its opening tag: ``[``, the calls, ``]`` and the
        closing tag."""
        more = ' ("," call)*' if parallel else ""
        return [f'rest: "[" call{more} {literal(self.closing)}']


SMOLLM2 = SmolLM2Format()
