"""OpenAI legacy Completions wire types and their validation (no Flask here).

Precedence for every field: the request's value, else the OpenAI default. ``null`` means absent, booleans are
not numbers, an unknown field is ignored (the v0 contract; the answer names it in ``X-Ignored-Fields``),
the documented fields this server does not implement (``suffix``, ``best_of`` above 1) and other servers'
constraint fields are a 400 saying so, and every violation is a 400 naming its ``param``.

Source: OpenAI API reference, "Completions" (legacy); docs/ARCHITECTURE.md §6 and §8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from model.sampling import SamplingParams
from model.tokenizer import ByteTokenizer, TextTokenizer
from model.utf8 import Utf8Decoder
from wsgi_app.api.errors import invalid
from wsgi_app.api.fields import (
    boolean_field,
    build_sampling,
    check_unicode,
    integer_field,
    is_int,
    parse_model,
    parse_sampling_fields,
    parse_stream_fields,
    stop_strings,
    unsupported,
)
from wsgi_app.api.structured import (
    STRUCTURED_FIELDS,
    RequestConstraint,
    parse_constraint,
    refuse_stop,
)
from wsgi_app.api.table import BOOLEAN, NUMBER, SHARED_FIELDS, TEXT, Field, FieldTable

MAX_TOKENS_LIMIT = 4096
MAX_LOGPROBS = 5

# The request fields of OpenAI's legacy Completions (and the shared extensions); anything else is ignored
# (and named in the answer's X-Ignored-Fields), except another server's constraint field.
FIELDS = FieldTable(
    (
        *SHARED_FIELDS,
        Field("prompt", TEXT),
        Field("suffix", unsupported=True),
        Field("max_tokens", NUMBER),
        Field("logprobs", NUMBER),
        Field("echo", BOOLEAN),
        Field("best_of", unsupported=True),  # 1 is accepted: it changes nothing
        *STRUCTURED_FIELDS,  # response_format is an extension here
    )
)


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt of a request.

    Attributes:
        ids: its token ids (the model tokenizer's; bytes for the bigram), non-empty.
        text: the prompt as text (for ``echo`` and logs): the string sent, or the token ids' bytes
            decoded with U+FFFD for invalid UTF-8.
        tail: the last bytes of a token-id prompt that begin a UTF-8 character without ending it
            (``text`` shows them as one U+FFFD); with ``echo`` they begin the completion's bytes,
            which may finish that character.
    """

    ids: tuple[int, ...]
    text: str
    tail: bytes = b""


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A validated ``POST /v1/completions`` request (its generation input:
    ``wsgi_app.generation.inputs.generation_input``).

    Attributes:
        model: the requested model name, echoed in every answer.
        prompt_ids: the (first) prompt's token ids (the model tokenizer's; bytes for the bigram).
        prompt_text: the (first) prompt as text (for ``echo``).
        max_tokens: tokens to generate per choice, 0..4096 (0 only with ``echo``).
        sampling: the sampling parameters of docs/ARCHITECTURE.md §6.
        seed: 0..2**64-1, or None when the server should pick one (absent, ``null`` or ``-1``).
        n: number of choices.
        stop: up to 4 non-empty stop strings.
        echo: prepend the prompt to each choice's text.
        logprobs: number of top alternatives to report per token (0..5), or None for no logprobs.
        stream: answer as Server-Sent Events.
        include_usage: with ``stream``, send a final usage chunk before ``[DONE]``.
        ignore_eos: keep generating past the model's end-of-sequence token (vLLM's extension).
        prompt_tail: the first prompt's :attr:`Prompt.tail`.
        more_prompts: the prompts after the first of a batch (OpenAI's list of prompts).
        cache_salt: the request's ``cache_salt`` (vLLM's extension), "" without one.
        ignored_fields: the unknown top-level fields the request sent, sorted, as the
            ``X-Ignored-Fields`` header lists them (``wsgi_app.api.table.shown_names``).
        constraint: the output constraint (structured outputs, ``wsgi_app.api.structured``), or None.
        max_tokens_asked: False when ``max_tokens`` is the server's default for a chat answer
            (the rest of the context up to ``CHAT_MAX_TOKENS``): a cap, never refused by the
            operator's pace, never a reason to leave the queue early.
    """

    model: str
    prompt_ids: tuple[int, ...]
    prompt_text: str
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
    prompt_tail: bytes = b""
    more_prompts: tuple[Prompt, ...] = ()
    cache_salt: str = ""
    ignored_fields: tuple[str, ...] = ()
    constraint: RequestConstraint | None = None
    max_tokens_asked: bool = True

    def prompts(self) -> tuple[Prompt, ...]:
        """Return every prompt of the request, in order (prompt ``p`` has choices ``p*n .. p*n+n-1``)."""
        return (Prompt(self.prompt_ids, self.prompt_text, self.prompt_tail), *self.more_prompts)

    @property
    def prompt_tokens(self) -> int:
        """Return the prompt tokens of every prompt, summed (``usage.prompt_tokens``)."""
        return len(self.prompt_ids) + sum(len(p.ids) for p in self.more_prompts)


def _prompt_list(value: Any) -> list[Any]:
    """Split ``prompt`` into its prompts: a string or a token array is one prompt; a list of strings
    or a list of token arrays is a batch (OpenAI's forms)."""
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value) or all(isinstance(p, list) for p in value):
            return value
    return [value]


def _prompt(value: Any, max_prompt_tokens: int, tokenizer: TextTokenizer, where: str) -> Prompt:
    vocab_size = tokenizer.vocab_size
    tail = b""
    if isinstance(value, str):
        check_unicode(value, "prompt")
        if not value:
            raise invalid(f"'{where}' must not be empty.", "prompt")
        if isinstance(tokenizer, ByteTokenizer):
            # One token a byte: the length decides before a million-int list is built.
            n_bytes = len(value.encode("utf-8"))
            if n_bytes > max_prompt_tokens:
                raise invalid(
                    f"'{where}' is {n_bytes} tokens; the limit is {max_prompt_tokens}.", "prompt"
                )
        ids = tuple(tokenizer.encode(value))
        text = value
    elif isinstance(value, list) and value and all(is_int(t) for t in value):
        bad = next((t for t in value if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise invalid(
                f"Token id {bad} in '{where}' is outside the vocabulary 0..{vocab_size - 1}.",
                "prompt",
            )
        ids = tuple(value)
        decoder = Utf8Decoder()
        text = decoder.feed(b"".join(tokenizer.token_bytes[t] for t in ids))
        tail = decoder.pending
        text += decoder.finish()
    else:
        raise invalid(
            "'prompt' must be a non-empty string, a list of token ids, or a non-empty list of "
            "strings or of token-id lists.",
            "prompt",
        )
    if not ids:
        raise invalid(f"'{where}' must not be empty.", "prompt")
    if len(ids) > max_prompt_tokens:
        raise invalid(
            f"'{where}' is {len(ids)} tokens; the limit is {max_prompt_tokens}.", "prompt"
        )
    return Prompt(ids, text, tail)


def parse_completion_request(
    body: dict[str, Any],
    *,
    max_prompt_tokens: int = 32_768,
    max_n: int = 8,
    tokenizer: TextTokenizer | None = None,
    context_length: int | None = None,
    max_logprob_entries: int = 262_144,
) -> CompletionRequest:
    """Validate a decoded ``/v1/completions`` body into a :class:`CompletionRequest`.

    Args:
        body: the decoded JSON object.
        max_prompt_tokens: prompt length limit in tokens (``MAX_PROMPT_TOKENS``).
        max_n: largest accepted ``n`` (``MAX_N``).
        tokenizer: the model's tokenizer (default: bytes, the bigram's).
        context_length: the model's context in tokens (prompt + completion), or None for no limit.
        max_logprob_entries: the request's budget of ``logprobs`` entries (``MAX_LOGPROB_ENTRIES``).

    Raises:
        ApiError: 400 naming the first invalid field in ``param``; another server's constraint
            field (``wsgi_app.api.table.CONSTRAINT_FIELDS``) first of all.
    """
    ignored = FIELDS.check(body)
    model = parse_model(body)
    if "prompt" not in body or body["prompt"] is None:
        raise invalid("'prompt' is required.", "prompt")
    tokenizer = tokenizer or ByteTokenizer()
    vocab_size = tokenizer.vocab_size
    values = _prompt_list(body["prompt"])
    if len(values) > max_n:  # before tokenizing them all
        raise invalid(
            f"'prompt' holds {len(values)} prompts; a request makes at most MAX_N ({max_n}) "
            "choices (prompts × n).",
            "prompt",
        )
    prompts = [
        _prompt(v, max_prompt_tokens, tokenizer, "prompt" if len(values) == 1 else f"prompt[{i}]")
        for i, v in enumerate(values)
    ]

    for name in FIELDS.unsupported:
        value = body.get(name)
        if value is not None and not (name == "best_of" and value == 1 and is_int(value)):
            raise unsupported(name)

    echo = boolean_field(body, "echo")
    max_tokens = integer_field(body, "max_tokens", 16, 0, MAX_TOKENS_LIMIT)
    if max_tokens == 0 and not echo:
        raise invalid(
            "'max_tokens' must be at least 1 (0 is allowed only with 'echo').", "max_tokens"
        )
    fields = parse_sampling_fields(body, vocab_size, max_n)
    if len(prompts) * fields.n > max_n:
        raise invalid(
            f"{len(prompts)} prompts × 'n' {fields.n} = {len(prompts) * fields.n} choices; a "
            f"request makes at most MAX_N ({max_n}) choices (prompts × n).",
            "n",
        )
    logprobs = integer_field(body, "logprobs", None, 0, MAX_LOGPROBS)
    if logprobs is not None:
        _check_logprob_budget(prompts, fields.n, max_tokens, echo, logprobs, max_logprob_entries)
    stream = parse_stream_fields(body)
    if context_length is not None:
        for p in prompts:
            _check_context(len(p.ids), max_tokens, context_length)

    first = prompts[0]
    stop = stop_strings(body.get("stop"))
    return CompletionRequest(
        model=model,
        prompt_ids=first.ids,
        prompt_text=first.text,
        prompt_tail=first.tail,
        more_prompts=tuple(prompts[1:]),
        max_tokens=max_tokens,
        sampling=build_sampling(fields, body, vocab_size),
        seed=fields.seed,
        n=fields.n,
        stop=stop,
        echo=echo,
        logprobs=logprobs,
        stream=stream.stream,
        include_usage=stream.include_usage,
        ignore_eos=stream.ignore_eos,
        cache_salt=stream.cache_salt,
        ignored_fields=ignored,
        constraint=refuse_stop(parse_constraint(body), stop),
    )


def logprob_entries(
    prompts: tuple[Prompt, ...] | list[Prompt], n: int, max_tokens: int, echo: bool, logprobs: int
) -> int:
    """Return the most ``logprobs`` entries a request can make: choices × (``max_tokens`` + echoed
    prompt tokens) × (``logprobs`` + 1), each choice's tokens counted with its own prompt."""
    tokens = sum(n * (max_tokens + (len(p.ids) if echo else 0)) for p in prompts)
    return tokens * (logprobs + 1)


def _check_logprob_budget(
    prompts: list[Prompt], n: int, max_tokens: int, echo: bool, logprobs: int, budget: int
) -> None:
    """Refuse a request whose ``logprobs`` could exceed ``budget`` entries: every token of every
    choice (the echoed prompt's too) holds ``logprobs + 1`` numbers until the answer is written, so
    this bounds what one request makes the worker hold (a 33 KB body could otherwise ask for 44 MB of
    JSON and far more in memory)."""
    entries = logprob_entries(prompts, n, max_tokens, echo, logprobs)
    if entries > budget:
        tokens = entries // (logprobs + 1)
        echoed = " + the echoed prompt" if echo else ""
        raise invalid(
            f"This request could return {entries} logprobs entries (choices × ('max_tokens'"
            f"{echoed}) × ('logprobs' + 1) = {tokens} × {logprobs + 1}); the limit is "
            f"MAX_LOGPROB_ENTRIES ({budget}). Reduce 'logprobs', 'max_tokens', 'n' or the prompt.",
            "logprobs",
        )


def _check_context(prompt_tokens: int, max_tokens: int, context_length: int) -> None:
    """Refuse a prompt that leaves no room, or a prompt + completion beyond the model's context."""
    if prompt_tokens >= context_length:
        raise invalid(
            f"This model's maximum context length is {context_length} tokens; the prompt has "
            f"{prompt_tokens} tokens, which leaves no room for a completion.",
            "prompt",
        )
    if prompt_tokens + max_tokens > context_length:
        raise invalid(
            f"This model's maximum context length is {context_length} tokens; you requested "
            f"{prompt_tokens + max_tokens} ({prompt_tokens} in the prompt, {max_tokens} for the "
            f"completion). Reduce the prompt or 'max_tokens'.",
            "max_tokens",
        )
