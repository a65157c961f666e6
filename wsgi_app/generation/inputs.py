"""What a generation request asks for, whatever wire it came by: :class:`GenerationInput`.

The wire types (``wsgi_app.api``: ``CompletionRequest``, ``ChatRequest``) are what a client sent,
validated; a ``GenerationInput`` is what the generation runs from — its prompts and what to sample
(vLLM's prompt and ``SamplingParams``), its output constraint and tools, and how its answer is shown.
It is the request-level counterpart of ``model.engine.GenerationRequest`` (one choice's engine
input), which ``wsgi_app.generation.completion.Completion`` makes from it for every choice. An
endpoint builds one with :func:`generation_input` and hands it to ``wsgi_app.http.answer.answer``;
nothing fills it in later (a constraint's compiled grammar travels beside it, from
``wsgi_app.generation.grammars.GrammarService.prepare``).

Source: docs/ARCHITECTURE.md §3 (the life of a request), §14 (tool calls).
"""

from __future__ import annotations

from dataclasses import dataclass

from model.sampling import SamplingParams
from model.tool_formats import ToolFormat
from wsgi_app.api.completions import CompletionRequest, Prompt
from wsgi_app.api.structured import RequestConstraint
from wsgi_app.api.tools import ToolRequest


@dataclass(frozen=True, slots=True)
class GenerationInput:
    """One generation request's input: its prompts, sampling, constraint, tools and answer shape.

    Attributes:
        model: the requested model name, echoed in every answer.
        prompts: the prompts, in order (prompt ``p`` has choices ``p*n .. p*n+n-1``), non-empty.
        max_tokens: tokens to generate per choice, 0..4096 (0 only with ``echo``).
        sampling: the sampling parameters of docs/ARCHITECTURE.md §6.
        seed: 0..2**64-1, or None when the server should pick one.
        n: choices per prompt.
        stop: stop strings (the request's, then a chat template's).
        echo: prepend each prompt to its choices' text.
        logprobs: top alternatives to report per token (0..5), or None for no logprobs.
        stream: answer as Server-Sent Events.
        include_usage: with ``stream``, send a final usage chunk before ``[DONE]``.
        ignore_eos: keep generating past the model's end-of-sequence token.
        cache_salt: the request's ``cache_salt`` (prefix-cache isolation), "" without one.
        ignored_fields: the unknown top-level fields the request sent, sorted (``X-Ignored-Fields``).
        constraint: the output constraint, with the ``param`` a refusal names, or None.
        tools: the tools and tool choice, with the ``param`` names a refusal uses, or None.
        tool_format: the format the model writes its calls in (``ChatTemplate.tool_format``);
            None without tools.
        max_tokens_asked: False when ``max_tokens`` is the server's default for a chat answer (a
            cap: never refused by the operator's pace, never a reason to leave the queue early).
        reported_stops: the stop strings whose match the answer names (Anthropic's
            ``stop_sequence``: the client's ``stop_sequences``, not the template's); () for none.
    """

    model: str
    prompts: tuple[Prompt, ...]
    max_tokens: int
    sampling: SamplingParams
    seed: int | None
    n: int = 1
    stop: tuple[str, ...] = ()
    echo: bool = False
    logprobs: int | None = None
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    cache_salt: str = ""
    ignored_fields: tuple[str, ...] = ()
    constraint: RequestConstraint | None = None
    tools: ToolRequest | None = None
    tool_format: ToolFormat | None = None
    max_tokens_asked: bool = True
    reported_stops: tuple[str, ...] = ()

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may hold tool calls (tools given, ``tool_choice`` not ``none``)."""
        return self.tools is not None and self.tools.choice != "none"

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        """The first prompt's token ids."""
        return self.prompts[0].ids

    @property
    def prompt_text(self) -> str:
        """The first prompt as text (for ``echo`` and the logged prompt)."""
        return self.prompts[0].text

    @property
    def prompt_tokens(self) -> int:
        """The prompt tokens of every prompt, summed (``usage.prompt_tokens``)."""
        return sum(len(p.ids) for p in self.prompts)


def generation_input(
    req: CompletionRequest,
    tools: ToolRequest | None = None,
    tool_format: ToolFormat | None = None,
    reported_stops: tuple[str, ...] = (),
) -> GenerationInput:
    """Return the generation input of a validated request: a completion, or a chat or Messages
    request once its template has rendered the prompt (``wsgi_app.api.chat.completion_request``,
    ``wsgi_app.api.anthropic.completion_request``), with its tools.

    Args:
        req: the request's prompts, sampling and answer fields.
        tools: a chat request's tools and tool choice, or None.
        tool_format: the format the served model writes calls in (``ChatTemplate.tool_format``);
            required with ``tools``.
        reported_stops: the stop strings of ``req.stop`` whose match the answer names.

    Raises:
        ValueError: ``tools`` without ``tool_format``.
    """
    if tools is not None and tool_format is None:
        raise ValueError("a request with tools needs the model's tool-call format")
    return GenerationInput(
        model=req.model,
        prompts=req.prompts(),
        max_tokens=req.max_tokens,
        sampling=req.sampling,
        seed=req.seed,
        n=req.n,
        stop=req.stop,
        echo=req.echo,
        logprobs=req.logprobs,
        stream=req.stream,
        include_usage=req.include_usage,
        ignore_eos=req.ignore_eos,
        cache_salt=req.cache_salt,
        ignored_fields=req.ignored_fields,
        constraint=req.constraint,
        tools=tools,
        tool_format=tool_format if tools is not None else None,
        max_tokens_asked=req.max_tokens_asked,
        reported_stops=reported_stops,
    )
