"""A Jinja2 sandbox whose renders are bounded in time and in the size of every value they build.

Chat templates come from model files and settings, so they are code we did not write. Jinja2's
``ImmutableSandboxedEnvironment`` stops a template from reaching Python internals or mutating its
inputs, and caps ``range()`` at ``jinja2.sandbox.MAX_RANGE`` items, but a template can still burn CPU
without end (nested loops, recursive macros) or build a value of any size (``'a' * 10**10``, a string
doubled in a loop, a list of shared references printed as text). Each render here therefore runs
under a :class:`RenderBudget`:

- time: a deadline checked on every Python call and on every line of template code (through
  ``sys.settrace`` for the duration of the render);
- size: every operation the template language offers that makes a value bigger than its operands
  (``~``, ``+``, ``*``, ``**``, ``%``, ``str.format``, the padding/replacing/joining string methods and
  filters, ``tojson``, output of ``{{ ... }}``) first checks the size of what it would make against
  ``max_chars`` (lists count their items' sizes plus one per item, so shared references are counted
  each time they would be printed and a list of empty strings is not free), and the sizes made are
  charged to a per-render total of ``16 * max_chars``;
- length: no list, tuple or dict a template makes may hold more than ``MAX_ITEMS`` items (each item
  is a pointer in memory whatever it prints as);
- word-wise filters (``title``, ``wordwrap``, ``urlize``, ``striptags``), which make one Python
  object per word without a call the deadline could interrupt, take at most ``MAX_WORDWISE_CHARS``;
- ``lipsum`` is removed (it writes paragraphs on request).

Exceeding either raises :class:`TemplateError`.

Source: Jinja2 "Sandbox" documentation (``intercepted_binops``, ``call_binop``, ``call``).
"""

from __future__ import annotations

import contextvars
import json
import re
import string
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from jinja2.compiler import CodeGenerator, Frame
from jinja2.nodes import Concat
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_INT_BITS = 1 << 16
MAX_TOJSON_INDENT = 16
MAX_ITEMS = 1 << 17
MAX_WORDWISE_CHARS = 1 << 18
_WORDWISE_FILTERS = {"title", "wordwrap", "urlize", "striptags"}
_WIDTH = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")
_SPEC_NUMBER = re.compile(r"\d+")
_PADDING_METHODS = {"center", "ljust", "rjust", "zfill"}


class TemplateError(ValueError):
    """A chat template failed to compile or render, ran out of budget, or called ``raise_exception``.

    ``str(error)`` is the message to show a client (a template's own ``raise_exception`` message
    verbatim).
    """


@dataclass(slots=True)
class RenderBudget:
    """What one render may still spend.

    Attributes:
        deadline: ``time.perf_counter()`` value after which the render stops, seconds.
        max_chars: the largest value (or output) one operation may make, in characters.
        chars_left: characters the render may still make in total.
    """

    deadline: float
    max_chars: int
    chars_left: int

    def charge(self, size: int, what: str) -> None:
        """Account for a value of ``size`` characters about to be made by ``what``.

        Raises:
            TemplateError: if it is over ``max_chars``, or the render's total is spent.
        """
        if size > self.max_chars:
            raise TemplateError(
                f"chat template: {what} would make {size} characters; the limit is {self.max_chars}"
            )
        self.chars_left -= size
        if self.chars_left < 0:
            raise TemplateError("chat template: the render made too much text in total")

    def check_items(self, n_items: int, what: str) -> None:
        """Refuse a list, tuple or dict of ``n_items`` items over :data:`MAX_ITEMS`.

        Raises:
            TemplateError: if it is over.
        """
        if n_items > MAX_ITEMS:
            raise TemplateError(
                f"chat template: {what} would make {n_items} items; the limit is {MAX_ITEMS}"
            )

    def charge_value(self, value: Any, what: str) -> None:
        """Account for ``value`` just made by ``what``: its length if a container, and its weight.

        Raises:
            TemplateError: as :meth:`charge` and :meth:`check_items`.
        """
        if isinstance(value, list | tuple | dict):
            self.check_items(len(value), what)
        self.charge(weight(value), what)


_BUDGET: contextvars.ContextVar[RenderBudget | None] = contextvars.ContextVar(
    "chat_template_budget", default=None
)


def _budget() -> RenderBudget:
    budget = _BUDGET.get()
    if budget is None:  # a bounded environment is only ever rendered through bounded_render
        raise TemplateError("chat template rendered outside a budget")
    return budget


def weight(value: Any, _seen: dict[int, int] | None = None) -> int:
    """Return how many characters ``value`` takes when printed, roughly (shared items count each time).

    Strings count their length, lists/tuples/dicts 2 plus, per item, 1 (its separator) and its
    weight; anything else 8. Memoised per object, so a structure of shared references costs its
    unique objects to measure.
    """
    seen = {} if _seen is None else _seen
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list | tuple | dict):
        key = id(value)
        if key not in seen:
            seen[key] = 0  # a cycle (impossible in the immutable sandbox) counts as empty
            items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
            seen[key] = 2 + sum(1 + weight(item, seen) for item in items)
        return seen[key]
    return 8


def _check_int(value: Any, what: str) -> None:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise TemplateError(f"chat template: {what} makes an integer over {MAX_INT_BITS} bits")


def _check_percent_format(fmt: str) -> None:
    for match in _WIDTH.finditer(fmt):
        for number in match.groups():
            if number == "*" or (number is not None and int(number) > _budget().max_chars):
                raise TemplateError("chat template: a '%' format width is too large")


def _check_brace_format(fmt: str) -> None:
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError as exc:
        raise TemplateError(f"chat template: {exc}") from None
    for _, _, spec, _ in fields:
        if spec and (
            "{" in spec or any(int(n) > _budget().max_chars for n in _SPEC_NUMBER.findall(spec))
        ):
            raise TemplateError("chat template: a format width is too large")


def _check_call(func: Any, args: tuple, kwargs: dict) -> None:
    """Refuse a string method call that would make a value over the budget, before it runs."""
    target = getattr(func, "__wrapped__", func)  # the sandbox wraps str.format
    owner = getattr(target, "__self__", None)
    if not isinstance(owner, str):
        return
    name = getattr(target, "__name__", "")
    budget = _budget()
    if name in _PADDING_METHODS and args and isinstance(args[0], int):
        budget.charge(max(args[0], len(owner)), f"str.{name}")
    elif name == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tabsize, int):
            budget.charge(len(owner) + owner.count("\t") * max(tabsize, 0), "str.expandtabs")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str):
        budget.charge(len(owner) + (owner.count(args[0]) + 1) * weight(args[1]), "str.replace")
    elif name == "join" and args:
        items = list(args[0]) if not isinstance(args[0], list | tuple) else args[0]
        budget.charge(sum(weight(i) for i in items) + len(owner) * len(items), "str.join")
    elif name in ("format", "format_map"):
        _check_brace_format(owner)


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a filter so its arguments and result are charged, with checks for growing parameters."""

    def check_params(value: Any, args: tuple, kwargs: dict) -> None:
        budget = _budget()
        if name in _WORDWISE_FILTERS and isinstance(value, str) and len(value) > MAX_WORDWISE_CHARS:
            raise TemplateError(
                f"chat template: the '{name}' filter takes at most {MAX_WORDWISE_CHARS} characters"
            )
        if name in ("center", "indent", "batch", "wordwrap") and args and isinstance(args[0], int):
            lines = value.count("\n") + 1 if isinstance(value, str) else 1
            budget.charge(weight(value) + args[0] * lines, f"the '{name}' filter")
        elif name == "format" and isinstance(value, str):
            _check_percent_format(value)
        elif name == "replace" and len(args) >= 2 and isinstance(value, str):
            budget.charge(
                len(value) + (value.count(str(args[0])) + 1) * weight(args[1]), "'replace'"
            )
        elif name == "sum" and not isinstance(
            kwargs.get("start", args[1] if len(args) > 1 else 0), int | float
        ):
            raise TemplateError("chat template: the 'sum' filter only adds numbers here")

    def bounded(*all_args: Any, **kwargs: Any) -> Any:
        # pass_context / pass_eval_context filters get the context first; the value follows it.
        offset = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0
        value, args = (
            (all_args[offset], all_args[offset + 1 :]) if len(all_args) > offset else (None, ())
        )
        check_params(value, args, kwargs)
        result = func(*all_args, **kwargs)
        if isinstance(result, str | list | tuple | dict):
            _budget().charge_value(result, f"the '{name}' filter")
        return result

    bounded.__wrapped__ = func  # type: ignore[attr-defined]
    if hasattr(func, "jinja_pass_arg"):
        bounded.jinja_pass_arg = func.jinja_pass_arg  # type: ignore[attr-defined]
    return bounded


def tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Serialise ``value`` as JSON without HTML escaping, with ``json.dumps``'s options.

    Source: Hugging Face transformers' chat-template ``tojson`` filter (the same keyword arguments).
    """
    size = indent if isinstance(indent, int) else len(indent or "")
    if size > MAX_TOJSON_INDENT:
        raise TemplateError(f"chat template: tojson indent is at most {MAX_TOJSON_INDENT}")
    _budget().charge(weight(value), "tojson")
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _BoundedCodeGenerator(CodeGenerator):
    """Compile ``a ~ b`` into a join that checks the size of its result first."""

    def visit_Concat(self, node: Concat, frame: Frame) -> None:  # noqa: N802 - Jinja's visitor name
        self.write("environment.bounded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """An ``ImmutableSandboxedEnvironment`` whose value-making operations check a :class:`RenderBudget`.

    Templates compiled here must be rendered through :func:`bounded_render`.
    """

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self, **options: Any) -> None:
        """Create the environment (options as ``jinja2.Environment``); filters are wrapped, no lipsum."""
        super().__init__(finalize=self._finalize, **options)
        self.globals.pop("lipsum", None)

    def wrap_filters(self) -> None:
        """Put every registered filter behind its budget check (call after adding filters)."""
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}

    @staticmethod
    def _finalize(value: Any) -> Any:
        # Jinja also finalizes constants at compile time, outside any render (and budget): those
        # come from the template source, whose size the caller bounds. Strings are charged too: a
        # macro or block collects its output and joins it in one C call no deadline interrupts.
        budget = _BUDGET.get()
        if budget is not None:
            budget.charge(weight(value), "printing a value")
        return value

    @staticmethod
    def bounded_join(values: tuple) -> str:
        """Join ``values`` as ``~`` does, after checking the size of the result."""
        _budget().charge(sum(weight(v) for v in values), "'~'")
        return "".join(map(str, values))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        """Apply ``+``, ``*``, ``**`` or ``%`` after checking the size of what it would make."""
        budget = _budget()
        sequence = (str, list, tuple)
        if operator == "+" and isinstance(left, sequence) and isinstance(right, sequence):
            if not isinstance(left, str):
                budget.check_items(len(left) + len(right), "'+'")
            budget.charge(weight(left) + weight(right), "'+'")
        elif operator == "*":
            if isinstance(left, int) and isinstance(right, sequence):
                left, right = right, left
            if isinstance(left, sequence) and isinstance(right, int):
                if not isinstance(left, str):
                    budget.check_items(len(left) * max(right, 0), "'*'")
                budget.charge(weight(left) * max(right, 0), "'*'")
            elif isinstance(left, int) and isinstance(right, int):
                _check_int(1 << (left.bit_length() + right.bit_length()), "'*'")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if abs(left) > 1 and right > 0:
                _check_int(1 << min(right * left.bit_length(), MAX_INT_BITS + 1), "'**'")
        elif operator == "%" and isinstance(left, str):
            _check_percent_format(left)
        result = super().call_binop(context, operator, left, right)
        if isinstance(result, str):
            budget.charge(len(result), f"'{operator}'")
        return result

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        """Call ``__obj`` from template code, refusing string methods that would overspend."""
        _check_call(__obj, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        if isinstance(result, str | list | tuple | dict):
            _budget().charge_value(result, "a call")
        return result


@contextmanager
def _deadline_trace(deadline: float) -> Iterator[None]:
    """Check ``deadline`` on every Python call and every line of template code, then restore tracing."""

    def on_line(frame: Any, event: str, arg: Any) -> Any:
        if time.perf_counter() > deadline:
            raise TemplateError("chat template: rendering took too long")
        return on_line

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        if time.perf_counter() > deadline:
            raise TemplateError("chat template: rendering took too long")
        # Loops in template code jump back to a line; loops in Jinja's runtime call generators.
        return on_line if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        yield
    finally:
        sys.settrace(previous)


def bounded_render(
    generate: Callable[[], Iterator[str]], max_chars: int, max_render_s: float
) -> str:
    """Run one render of a :class:`BoundedEnvironment` template within a time and size budget.

    Args:
        generate: returns the template's output generator (``lambda: template.generate(**ctx)``).
        max_chars: the largest output, and the largest value one operation may make, in characters.
        max_render_s: wall-clock time the render may take, seconds.

    Returns:
        The rendered text.

    Raises:
        TemplateError: over budget; every other exception propagates for the caller to wrap.
    """
    budget = RenderBudget(time.perf_counter() + max_render_s, max_chars, 16 * max_chars)
    token = _BUDGET.set(budget)
    out: list[str] = []
    size = 0
    try:
        with _deadline_trace(budget.deadline):
            for chunk in generate():
                size += len(chunk)
                if size > max_chars:
                    raise TemplateError(
                        f"chat template: the rendered prompt is over {max_chars} characters"
                    )
                out.append(chunk)
    finally:
        _BUDGET.reset(token)
    return "".join(out)
