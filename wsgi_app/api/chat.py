"""OpenAI Chat Completions request validation (no Flask here).

The sampling fields are parsed by the same functions as ``/v1/completions`` (``wsgi_app.api.completions``),
so a :class:`ChatRequest` carries the same values, and :func:`completion_request` turns it, once the
chat template has made the prompt, into the :class:`~wsgi_app.api.completions.CompletionRequest` the
generation pipeline already serves. An unknown top-level field is ignored, as on the legacy endpoint
(the answer names it in ``X-Ignored-Fields``); documented OpenAI fields this server does not implement
(audio...) are a 400 saying so, never silently ignored; an output constraint in any spelling is
read by ``wsgi_app.api.structured``. ``null`` means absent.

Source: OpenAI API reference, "Chat Completions" (create).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from model.sampling import SamplingParams
from wsgi_app.api.completions import MAX_TOKENS_LIMIT, CompletionRequest
from wsgi_app.api.errors import invalid, quote_name
from wsgi_app.api.fields import (
    boolean_field,
    build_sampling,
    check_unicode,
    integer_field,
    parse_model,
    parse_sampling_fields,
    parse_stream_fields,
    stop_strings,
    unsupported,
)
from wsgi_app.api.messages import parse_messages
from wsgi_app.api.structured import (
    STRUCTURED_FIELDS,
    RequestConstraint,
    parse_constraint,
    refuse_stop,
)
from wsgi_app.api.table import (
    BOOLEAN,
    JSON,
    NUMBER,
    SHARED_FIELDS,
    Field,
    FieldTable,
    shown_names,
)
from wsgi_app.api.tools import ToolRequest, parse_tools

MAX_TOP_LOGPROBS = 20
MAX_CHAT_MESSAGES = 1024  # the MAX_CHAT_MESSAGES setting's default
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call")

# The request fields of OpenAI's Chat Completions (and the shared extensions); anything else is ignored
# (and named in X-Ignored-Fields). The documented fields this server does not implement are a 400 for
# any non-null value.
FIELDS = FieldTable(
    (
        *SHARED_FIELDS,
        Field("messages", JSON),
        Field("max_tokens", NUMBER),
        Field("max_completion_tokens", NUMBER),
        Field("logprobs", BOOLEAN),
        Field("top_logprobs", NUMBER),
        *STRUCTURED_FIELDS,  # response_format and the other spellings of an output constraint
        Field("modalities"),
        Field("store"),
        Field("service_tier"),
        Field("prompt_cache_key"),
        Field("safety_identifier"),
        *(Field(name) for name in TOOL_FIELDS),  # read by wsgi_app.api.tools
        *(
            Field(name, unsupported=True)
            for name in (
                "audio",
                "prediction",
                "web_search_options",
                "reasoning_effort",
                "verbosity",
                "metadata",
            )  # fmt: skip
        ),
    )
)


class Conversation(Protocol):
    """What a conversation endpoint asks for once validated, whatever its wire: a
    :class:`ChatRequest`, or a Responses request (``wsgi_app.api.responses``) once its items are
    the template's messages. :func:`completion_request` and
    ``wsgi_app.http.chat.chat_completion_request`` read only these (see :class:`ChatRequest` for
    each), so every such conversation is rendered, checked and generated the same way.

    Attributes:
        messages_param: the field a refusal of the conversation names (``messages``, ``input``).
    """

    model: str
    messages: tuple[dict[str, Any], ...]
    max_tokens: int | None
    max_tokens_param: str
    sampling: SamplingParams
    seed: int | None
    n: int
    stop: tuple[str, ...]
    logprobs: int | None
    stream: bool
    include_usage: bool
    ignore_eos: bool
    cache_salt: str
    ignored_fields: tuple[str, ...]
    constraint: RequestConstraint | None
    tools: ToolRequest | None
    messages_param: str


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A validated ``POST /v1/chat/completions`` request, before its template is rendered.

    Attributes:
        model: the requested model name, echoed in every answer.
        messages: ``({"role": "system"|"user"|"assistant", "content": str}, ...)``, non-empty;
            ``developer`` is ``system``, content parts are joined with ``"\\n"``; a message's
            ``name`` (and an assistant's ``reasoning_content``/``reasoning``) when sent, as strings,
            for the template.
        max_tokens: ``max_tokens`` or ``max_completion_tokens`` (1..4096), None when neither is given.
        max_tokens_param: which of the two the client sent (named by context-length errors).
        sampling: the sampling parameters, as on ``/v1/completions``.
        seed: 0..2**64-1, or None when the server should pick one.
        n: number of choices.
        stop: up to 4 non-empty stop strings from the request.
        logprobs: alternatives to report per token (``top_logprobs``, 0..20), or None for no logprobs.
        stream: answer as Server-Sent Events.
        include_usage: with ``stream``, send a final usage chunk before ``[DONE]``.
        ignore_eos: keep generating past end-of-sequence (vLLM's extension).
        user: the client's end-user id, or None (log it hashed).
        cache_salt: the request's ``cache_salt`` (vLLM's extension), "" without one.
        ignored_fields: the unknown top-level fields the request sent, and the schema keywords
            left out of tools that are not strict (``wsgi_app.api.tools.lenient_schema``), as
            ``X-Ignored-Fields`` lists them.
        constraint: the output constraint (``response_format`` and the other spellings of
            ``wsgi_app.api.structured``), or None.
        tools: the functions the model may call and how (``wsgi_app.api.tools``), or None.
    """

    model: str
    messages: tuple[dict[str, Any], ...]
    max_tokens: int | None
    max_tokens_param: str
    sampling: SamplingParams
    seed: int | None
    n: int = 1
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    user: str | None = None
    cache_salt: str = ""
    ignored_fields: tuple[str, ...] = ()
    constraint: RequestConstraint | None = None
    tools: ToolRequest | None = None
    messages_param: ClassVar[str] = "messages"


def parse_chat_request(
    body: dict[str, Any],
    *,
    vocab_size: int,
    max_n: int = 8,
    max_messages: int = MAX_CHAT_MESSAGES,
) -> ChatRequest:
    """Validate a decoded ``/v1/chat/completions`` body into a :class:`ChatRequest`.

    Args:
        body: the decoded JSON object (``wsgi_app.api.fields.decode_json_body``).
        vocab_size: the model's vocabulary (bounds ``top_k`` and ``logit_bias`` keys).
        max_n: largest accepted ``n`` (``MAX_N``).
        max_messages: the most messages accepted (``MAX_CHAT_MESSAGES``), checked before any is read.

    Raises:
        ApiError: 400 naming the first invalid field in ``param``: another server's constraint
            field, an unsupported one, or a bad value, down to the part
            (``messages[2].content[0].type``; an unknown key inside a message is still refused).
    """
    unknown = FIELDS.unknown(body)
    for name in FIELDS.unsupported:
        if body.get(name) is not None:
            raise unsupported(name)
    _check_options(body)
    model = parse_model(body)
    messages = parse_messages(body.get("messages"), max_messages)
    tools = parse_tools(body)
    max_tokens, max_tokens_param = _max_tokens(body)
    fields = parse_sampling_fields(body, vocab_size, max_n)
    logprobs = boolean_field(body, "logprobs")
    top_logprobs = integer_field(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top_logprobs is not None and not logprobs:
        raise invalid("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")
    stream = parse_stream_fields(body)
    stop = stop_strings(body.get("stop"))
    return ChatRequest(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        sampling=build_sampling(fields, body, vocab_size),
        seed=fields.seed,
        n=fields.n,
        stop=stop,
        logprobs=(top_logprobs or 0) if logprobs else None,
        stream=stream.stream,
        include_usage=stream.include_usage,
        ignore_eos=stream.ignore_eos,
        user=body.get("user"),
        cache_salt=stream.cache_salt,
        # A tool that is not strict is enforced without the keywords llguidance does not
        # implement: each is named as an ignored field is (wsgi_app.api.tools.lenient_schema).
        ignored_fields=shown_names([*unknown, *(tools.dropped_keywords() if tools else ())]),
        constraint=refuse_stop(parse_constraint(body), stop),
        tools=tools,
    )


def completion_request(
    chat: Conversation,
    prompt_ids: list[int] | tuple[int, ...],
    prompt_text: str,
    *,
    context_length: int | None,
    default_max_tokens: int,
    template_stop: tuple[str, ...] = (),
    kv_tokens_per_choice: int | None = None,
    max_logprob_entries: int | None = None,
) -> CompletionRequest:
    """Return the generation request for ``chat`` once its template has rendered the prompt.

    Args:
        chat: the validated conversation (a chat request, a Responses request).
        prompt_ids: the rendered prompt's token ids (``ChatTemplate.encode``).
        prompt_text: the rendered prompt (``ChatTemplate.render``).
        context_length: the model's context in tokens, or None for no limit.
        default_max_tokens: the cap on the default ``max_tokens`` (a server setting); without
            ``max_tokens`` the answer may use the rest of the context up to this cap.
        template_stop: stop strings the template needs (``ChatTemplate.stop``), added to the request's.
        kv_tokens_per_choice: the most tokens (prompt + answer) each of the ``n`` choices may hold
            within the worker's KV-cache budget (``KV_CACHE_BUDGET_MB``), or None for no budget:
            the default ``max_tokens`` is capped by it too. An explicit ``max_tokens`` is not (the
            admission refuses it, naming ``max_tokens``, when it cannot fit).
        max_logprob_entries: the request's budget of ``logprobs`` entries (``MAX_LOGPROB_ENTRIES``):
            choices × ``max_tokens`` × (``top_logprobs`` + 1), or None for no budget. A default
            ``max_tokens`` is capped by it; an explicit one over it is refused.

    Raises:
        ApiError: 400 naming the conversation (``messages``, ``input``) when the rendered prompt
            is empty, fills the context, or (without ``max_tokens``) leaves no room in the KV
            budget; 400 naming the client's
            ``max_tokens``/``max_completion_tokens`` when prompt + it exceed the context; 400
            ``top_logprobs`` when the answer's logprobs could exceed ``max_logprob_entries``.
    """
    n_prompt, param = len(prompt_ids), chat.messages_param
    room = prompt_room(n_prompt, context_length, param)
    max_tokens = chat.max_tokens
    if max_tokens is None:
        max_tokens = default_max_tokens if room is None else min(default_max_tokens, room)
        if kv_tokens_per_choice is not None:
            if kv_tokens_per_choice - n_prompt < 1:
                raise invalid(
                    f"The rendered conversation has {n_prompt} tokens; this server's KV-cache "
                    f"budget holds at most {kv_tokens_per_choice} tokens for each of the "
                    f"{chat.n} choices, which leaves no room for an answer.",
                    param,
                )
            max_tokens = min(max_tokens, kv_tokens_per_choice - n_prompt)
    else:
        check_answer_fits(n_prompt, max_tokens, room, context_length, chat.max_tokens_param, param)
    if chat.logprobs is not None and max_logprob_entries is not None:
        max_tokens = _logprob_budget(chat, max_tokens, max_logprob_entries)
    return CompletionRequest(
        model=chat.model,
        prompt_ids=tuple(prompt_ids),
        prompt_text=prompt_text,
        max_tokens=max_tokens,
        sampling=chat.sampling,
        seed=chat.seed,
        n=chat.n,
        stop=tuple(dict.fromkeys(chat.stop + tuple(template_stop))),
        logprobs=chat.logprobs,
        stream=chat.stream,
        include_usage=chat.include_usage,
        ignore_eos=chat.ignore_eos,
        cache_salt=chat.cache_salt,
        ignored_fields=chat.ignored_fields,
        constraint=chat.constraint,
        max_tokens_asked=chat.max_tokens is not None,
    )


def prompt_room(
    n_prompt: int, context_length: int | None, conversation: str = "messages"
) -> int | None:
    """Return the tokens a rendered prompt of ``n_prompt`` tokens leaves for an answer (None for a
    model without a context limit).

    Raises:
        ApiError: 400 naming the ``conversation`` (``messages``, a Responses request's
            ``input``) when the prompt is empty or fills the context.
    """
    if n_prompt == 0:
        raise invalid(
            f"The chat template rendered an empty prompt for '{conversation}'.", conversation
        )
    room = None if context_length is None else context_length - n_prompt
    if room is not None and room <= 0:
        raise invalid(
            f"This model's maximum context length is {context_length} tokens; the rendered "
            f"conversation has {n_prompt} tokens, which leaves no room for an answer.",
            conversation,
        )
    return room


def check_answer_fits(
    n_prompt: int,
    max_tokens: int,
    room: int | None,
    context_length: int | None,
    param: str,
    conversation: str = "messages",
) -> None:
    """Refuse a client's ``max_tokens`` (named ``param``) over the ``room`` a prompt of
    ``n_prompt`` tokens leaves in the context (:func:`prompt_room`; None: no limit); the message
    names the ``conversation`` field to shorten too.

    Raises:
        ApiError: 400 naming ``param``.
    """
    if room is not None and max_tokens > room:
        raise invalid(
            f"This model's maximum context length is {context_length} tokens; you requested "
            f"{n_prompt + max_tokens} ({n_prompt} in the rendered conversation, {max_tokens} for "
            f"the answer). Reduce the {conversation} or '{param}'.",
            param,
        )


def _logprob_budget(chat: Conversation, max_tokens: int, budget: int) -> int:
    """Return ``max_tokens`` within the request's ``logprobs`` budget: a default one is capped to
    it, an explicit one over it is refused (every token of every choice holds ``top_logprobs`` + 1
    entries until the answer is written; the completions endpoint's budget, without an echo).

    Raises:
        ApiError: 400 ``top_logprobs`` when even one token per choice, or the client's
            ``max_tokens``, is over ``budget``.
    """
    per_token = chat.n * (chat.logprobs + 1)
    most = budget // per_token
    if chat.max_tokens is None and most >= 1:
        return min(max_tokens, most)
    if max_tokens > most:
        param = chat.max_tokens_param if chat.max_tokens is not None else "max_tokens"
        raise invalid(
            f"This request could return {chat.n * max_tokens * (chat.logprobs + 1)} logprobs "
            f"entries (choices × '{param}' × ('top_logprobs' + 1) = {chat.n * max_tokens} × "
            f"{chat.logprobs + 1}); the limit is MAX_LOGPROB_ENTRIES ({budget}). Reduce "
            f"'top_logprobs', '{param}' or 'n'.",
            "top_logprobs",
        )
    return max_tokens


def _check_options(body: dict[str, Any]) -> None:
    """Accept the output options that mean "text" and ``store`` (either value: nothing is stored,
    as vLLM ignores it); refuse the others by name (``response_format`` is read by
    ``wsgi_app.api.structured``)."""
    modalities = body.get("modalities")
    if modalities is not None:
        if not isinstance(modalities, list) or not all(isinstance(m, str) for m in modalities):
            raise invalid("'modalities' must be a list of strings.", "modalities")
        if any(m != "text" for m in modalities):
            raise unsupported("modalities", "Output modalities other than 'text'")
    boolean_field(body, "store")  # true is accepted and nothing is stored, as vLLM does
    tier = body.get("service_tier")
    if tier is not None and (not isinstance(tier, str) or tier not in ("auto", "default")):
        raise unsupported("service_tier", f"'service_tier' {quote_name(tier)!r}")
    for name in ("user", "prompt_cache_key", "safety_identifier"):
        value = body.get(name)
        if value is not None:
            if not isinstance(value, str):
                raise invalid(f"'{name}' must be a string.", name)
            check_unicode(value, name)


def _max_tokens(body: dict[str, Any]) -> tuple[int | None, str]:
    legacy = integer_field(body, "max_tokens", None, 1, MAX_TOKENS_LIMIT)
    current = integer_field(body, "max_completion_tokens", None, 1, MAX_TOKENS_LIMIT)
    if legacy is not None and current is not None and legacy != current:
        raise invalid(
            "'max_tokens' and 'max_completion_tokens' are both given with different values; "
            "send one ('max_tokens' is deprecated).",
            "max_completion_tokens",
        )
    if current is not None:
        return current, "max_completion_tokens"
    return legacy, "max_tokens"
