"""OpenAI legacy Completions wire types and their validation (no Flask here).

Precedence for every field: the request's value, else the OpenAI default. ``null`` means absent, booleans are
not numbers, an unknown field is a 400 as OpenAI answers it ("Unrecognized request argument supplied"), the
documented fields this server does not implement (``suffix``, ``best_of`` above 1) are a 400 saying so, and
every violation is a 400 naming its ``param``.

Source: OpenAI API reference, "Completions" (legacy); docs/ARCHITECTURE.md §6 and §8.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from model.sampling import SamplingParams
from model.tokenizer import ByteTokenizer, TextTokenizer
from model.utf8 import Utf8Decoder
from wsgi_app.errors import invalid

MAX_TOKENS_LIMIT = 4096
MAX_MODEL_CHARS = 256
MAX_STOP = 4
MAX_LOGPROBS = 5
SEED_LIMIT = 1 << 64

# The request fields of OpenAI's legacy Completions, and the extensions shared with vLLM (top_k, min_p,
# ignore_eos); anything else is refused by name.
KNOWN_FIELDS = frozenset(
    {
        "model", "prompt", "suffix", "max_tokens", "temperature", "top_p", "n", "stream",
        "stream_options", "logprobs", "echo", "stop", "presence_penalty", "frequency_penalty",
        "best_of", "logit_bias", "user", "seed", "top_k", "min_p", "ignore_eos",
    }
)  # fmt: skip


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
    """A validated ``POST /v1/completions`` request.

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

    def prompts(self) -> tuple[Prompt, ...]:
        """Return every prompt of the request, in order (prompt ``p`` has choices ``p*n .. p*n+n-1``)."""
        return (Prompt(self.prompt_ids, self.prompt_text, self.prompt_tail), *self.more_prompts)

    @property
    def prompt_tokens(self) -> int:
        """Return the prompt tokens of every prompt, summed (``usage.prompt_tokens``)."""
        return len(self.prompt_ids) + sum(len(p.ids) for p in self.more_prompts)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key!r}")
        obj[key] = value
    return obj


def reject_unknown(body: dict[str, Any], known: frozenset[str]) -> None:
    """Refuse the first field of ``body`` that is not in ``known``, as OpenAI does.

    Raises:
        ApiError: 400 "Unrecognized request argument supplied: NAME" with ``param`` NAME.

    Source: OpenAI API reference (the error its API answers for an unknown request field).
    """
    for name in body:
        if name not in known:
            raise invalid(f"Unrecognized request argument supplied: {name}", name)


def decode_json_body(body: bytes) -> dict[str, Any]:
    """Parse a request body as one strict JSON object.

    Raises:
        ApiError: 400 when the body is not UTF-8, not JSON, uses ``NaN``/``Infinity`` literals, repeats a
            key, or is not an object.

    Source: RFC 8259 (JSON), which leaves duplicate names undefined; we refuse them rather than guess.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(
            f"Request body is not valid UTF-8: {exc.reason} at byte {exc.start}.", None
        ) from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as exc:
        raise invalid(f"Request body is not valid JSON: {exc}.", None) from None
    if not isinstance(obj, dict):
        raise invalid("Request body must be a JSON object.", None)
    return obj


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


def _integer(body: dict[str, Any], name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise invalid(f"'{name}' must be an integer, got {type(value).__name__}.", name)
    if not lo <= value <= hi:
        raise invalid(f"'{name}' must be in {lo}..{hi}, got {value}.", name)
    return value


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value):
        raise invalid(f"'{name}' must be a number, got {type(value).__name__}.", name)
    if not lo <= value <= hi:
        raise invalid(f"'{name}' must be in {lo:g}..{hi:g}, got {value}.", name)
    return float(value)


def _boolean(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(f"'{name}' must be a boolean, got {type(value).__name__}.", name)
    return value


def _check_unicode(text: str, name: str) -> None:
    # JSON can carry lone surrogates ("\\ud800") that no UTF-8 answer could echo back.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(f"'{name}' contains a lone surrogate code point.", name) from None


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
        _check_unicode(value, "prompt")
        if not value:
            raise invalid(f"'{where}' must not be empty.", "prompt")
        ids = tuple(tokenizer.encode(value))
        text = value
    elif isinstance(value, list) and value and all(_is_int(t) for t in value):
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


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("'stop' must be a string or a list of strings.", "stop")
    if len(stops) > MAX_STOP:
        raise invalid(f"'stop' holds at most {MAX_STOP} strings, got {len(stops)}.", "stop")
    if any(not s for s in stops):
        raise invalid("'stop' strings must not be empty.", "stop")
    for s in stops:
        _check_unicode(s, "stop")
    return tuple(stops)


def _logit_bias(value: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise invalid("'logit_bias' must be an object mapping token ids to numbers.", "logit_bias")
    bias: dict[int, float] = {}
    for key, weight in value.items():
        # Canonical decimal only ("1", not "01" or "+1"), checked before int(): no aliases of one id,
        # and no 5000-digit key for int() to choke on.
        canonical = key.isascii() and key.isdigit() and (key == "0" or not key.startswith("0"))
        if not canonical or len(key) > len(str(vocab_size)) or int(key) >= vocab_size:
            raise invalid(
                f"'logit_bias' key {key!r} is not a token id in 0..{vocab_size - 1}.", "logit_bias"
            )
        if not _is_number(weight) or not -100 <= weight <= 100:
            raise invalid(
                f"'logit_bias' value for {key} must be a number in -100..100.", "logit_bias"
            )
        bias[int(key)] = float(weight)
    return tuple(sorted(bias.items()))


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    value = body.get("stream_options")
    if value is None:
        return False
    if not stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true.", "stream_options")
    if not isinstance(value, dict):
        raise invalid("'stream_options' must be an object.", "stream_options")
    include = value.get("include_usage")
    if include is None:
        return False
    if not isinstance(include, bool):
        raise invalid("'stream_options.include_usage' must be a boolean.", "stream_options")
    return include


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
        ApiError: 400 naming the first invalid field in ``param``; an unknown field first of all.
    """
    reject_unknown(body, KNOWN_FIELDS)
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

    for unsupported in ("suffix", "best_of"):
        value = body.get(unsupported)
        if value is not None and not (unsupported == "best_of" and value == 1 and _is_int(value)):
            raise invalid(f"'{unsupported}' is not supported by this server.", unsupported)

    echo = _boolean(body, "echo")
    max_tokens = _integer(body, "max_tokens", 16, 0, MAX_TOKENS_LIMIT)
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
    logprobs = _integer(body, "logprobs", None, 0, MAX_LOGPROBS)
    if logprobs is not None:
        _check_logprob_budget(prompts, fields.n, max_tokens, echo, logprobs, max_logprob_entries)
    stream = parse_stream_fields(body)
    if context_length is not None:
        for p in prompts:
            _check_context(len(p.ids), max_tokens, context_length)

    first = prompts[0]
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
        stop=_stop(body.get("stop")),
        echo=echo,
        logprobs=logprobs,
        stream=stream.stream,
        include_usage=stream.include_usage,
        ignore_eos=stream.ignore_eos,
    )


def parse_model(body: dict[str, Any]) -> str:
    """Return the request's ``model``: a non-empty string of at most 256 characters.

    Raises:
        ApiError: 400 with ``param`` ``model``.
    """
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' must be a non-empty string.", "model")
    if len(model) > MAX_MODEL_CHARS:  # echoed in every chunk: bound it
        raise invalid(f"'model' is at most {MAX_MODEL_CHARS} characters.", "model")
    _check_unicode(model, "model")
    return model


@dataclass(frozen=True, slots=True)
class SamplingFields:
    """The sampling fields every generation endpoint shares, validated (see the OpenAI defaults)."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    seed: int | None
    n: int


def parse_sampling_fields(body: dict[str, Any], vocab_size: int, max_n: int) -> SamplingFields:
    """Validate ``temperature``, ``top_p``, ``top_k``, ``min_p``, the penalties, ``seed`` and ``n``.

    Raises:
        ApiError: 400 naming the first invalid field, checked in that order.
    """
    return SamplingFields(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=_integer(body, "top_k", 0, -1, vocab_size),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        seed=_seed(body),
        n=_integer(body, "n", 1, 1, max_n),
    )


def _seed(body: dict[str, Any]) -> int | None:
    """Return ``seed`` (0..2**64-1), or None when absent, ``null`` or ``-1``.

    ``-1`` is "pick a random seed" in llama.cpp and vLLM, and clients written for them send it; any
    other negative seed is still a 400.

    Raises:
        ApiError: 400 with ``param`` ``seed``.
    """
    value = body.get("seed")
    if _is_int(value) and value == -1:
        return None
    if _is_int(value) and not 0 <= value < SEED_LIMIT:
        raise invalid(
            f"'seed' must be in 0..{SEED_LIMIT - 1}, or -1 for a random seed, got {value}.", "seed"
        )
    return _integer(body, "seed", None, 0, SEED_LIMIT - 1)


@dataclass(frozen=True, slots=True)
class StreamFields:
    """``stream``, ``stream_options.include_usage`` and ``ignore_eos``, validated (``user`` checked)."""

    stream: bool
    include_usage: bool
    ignore_eos: bool


def parse_stream_fields(body: dict[str, Any]) -> StreamFields:
    """Validate ``stream``, ``stream_options``, ``user`` and ``ignore_eos``, in that order.

    Raises:
        ApiError: 400 naming the first invalid field.
    """
    stream = _boolean(body, "stream")
    include_usage = _stream_options(body, stream)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("'user' must be a string.", "user")
    return StreamFields(stream, include_usage, _boolean(body, "ignore_eos"))


def build_sampling(fields: SamplingFields, body: dict[str, Any], vocab_size: int) -> SamplingParams:
    """Return the :class:`SamplingParams` of ``fields`` and the body's ``logit_bias``.

    Raises:
        ApiError: 400 with ``param`` ``logit_bias``.
    """
    return SamplingParams(
        temperature=fields.temperature,
        top_k=max(fields.top_k, 0),  # -1 and 0 both mean "off" (vLLM's convention and ours)
        top_p=fields.top_p,
        min_p=fields.min_p,
        logit_bias=_logit_bias(body.get("logit_bias"), vocab_size),
        presence_penalty=fields.presence_penalty,
        frequency_penalty=fields.frequency_penalty,
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
