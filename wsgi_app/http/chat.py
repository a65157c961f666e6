"""A chat request becomes a completion request: the worker's chat template renders the conversation.

The template served is the ``CHAT_TEMPLATE`` file when set, else the model's own, else the default
template (``model.chat_template``); its tool template, which writes tools and tool-call history for a
chat template that does not read ``tools`` (``model.chat_tools``), is the ``TOOL_TEMPLATE`` file when
set, else ``model/templates/tools.jinja``. The master renders them once on :data:`SAMPLE_CONVERSATION`
and :data:`SAMPLE_TOOL_CONVERSATION` before any worker starts (:func:`check_chat_template`), so a
broken ``CHAT_TEMPLATE`` or ``TOOL_TEMPLATE`` stops the start with one line; a template that fails on
a request's conversation is a 400 on ``messages``.

Source: OpenAI API reference, "Chat Completions"; Hugging Face transformers, "Chat templates".
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from model.chat_template import ChatTemplate, TemplateError
from model.loader import LoadedModel
from model.tool_formats import FORMATS, SAMPLE_CALL, SAMPLE_TOOLS, ToolFormat, tool_format
from wsgi_app.api.chat import Conversation, completion_request
from wsgi_app.api.errors import invalid
from wsgi_app.api.tools import ToolRequest
from wsgi_app.generation.inputs import GenerationInput, generation_input
from wsgi_app.settings import Settings

# Turns every template accepts: alternating user and assistant, no system message (some templates
# refuse one).
SAMPLE_CONVERSATION = (
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hello. How can I help?"},
    {"role": "user", "content": "Name a colour."},
)
# A tool, a call of it and its result after a system message: what a TOOL_TEMPLATE must render.
SAMPLE_TOOL_CONVERSATION = ({"role": "system", "content": "Be brief."}, *SAMPLE_CALL)


def serving_template(model: LoadedModel, settings: Settings) -> ChatTemplate:
    """Return the chat template a worker serves ``model`` with.

    Raises:
        ValueError: one line naming ``CHAT_TEMPLATE`` (unreadable or not compiling), ``MODEL_DIR``
            (the model's own template does not compile; with ``MODELS_FILE``, "its chat template",
            for the caller to name the entry) or ``TOOL_TEMPLATE`` (unreadable, not
            compiling, or without one of its macros).
    """
    source = settings.chat_template_source()
    try:
        template = model.chat_template(source)
    except TemplateError as exc:
        if source is not None:
            raise ValueError(f"CHAT_TEMPLATE ({settings.chat_template}): {exc}") from None
        if settings.models_file is not None:  # the caller names the models file's entry
            raise ValueError(f"its chat template: {exc}") from None
        where = settings.model_dir or "the embedded default model"
        raise ValueError(f"MODEL_DIR ({where}): {exc}") from None
    tool_source = settings.tool_template_source()
    try:
        return template.with_tool_template(tool_source, settings.tool_call_format)
    except TemplateError as exc:
        raise ValueError(f"TOOL_TEMPLATE ({settings.tool_template}): {exc}") from None


def check_chat_template(model: LoadedModel, settings: Settings) -> None:
    """Build the template as a worker will and render it on :data:`SAMPLE_CONVERSATION` (in the
    master, before the workers start). A model's own template is only compiled: one that refuses
    this conversation may still serve others. A ``TOOL_TEMPLATE`` is rendered, in both tool-call
    formats, on :data:`SAMPLE_TOOL_CONVERSATION` under the default chat template (so the model's
    template cannot be what fails).

    Raises:
        ValueError: one line naming ``CHAT_TEMPLATE``, ``MODEL_DIR`` or ``TOOL_TEMPLATE`` and the
            template's error.
    """
    template = serving_template(model, settings)
    if settings.chat_template is not None:
        try:
            template.encode(SAMPLE_CONVERSATION, model.tokenizer)
        except TemplateError as exc:
            raise ValueError(
                f"CHAT_TEMPLATE ({settings.chat_template}): fails on a sample conversation: {exc}"
            ) from None
    if settings.tool_template is not None:
        tools = ChatTemplate.default().with_tool_template(template.tool_source)
        for fmt in FORMATS:
            try:
                tools.encode(SAMPLE_TOOL_CONVERSATION, model.tokenizer, SAMPLE_TOOLS, fmt)
            except TemplateError as exc:
                raise ValueError(
                    f"TOOL_TEMPLATE ({settings.tool_template}): fails on a sample conversation "
                    f"(tool_call_format {fmt}): {exc}"
                ) from None


@functools.lru_cache(maxsize=8)
def longest_token_bytes(tokenizer: Any) -> int:
    """Return the most bytes one token of ``tokenizer``'s vocabulary stands for (at least 1)."""
    return max(1, max(map(len, tokenizer.token_bytes), default=1))


def content_char_limit(tokenizer: Any, max_prompt_tokens: int) -> int:
    """Return the most message characters a prompt of ``max_prompt_tokens`` tokens can hold.

    No token stands for more than :func:`longest_token_bytes` bytes, and a character is at least
    one byte, so contents (surrounding whitespace aside, which templates may trim) longer than this
    cannot render into an acceptable prompt: they are refused before the template runs.
    """
    return max_prompt_tokens * longest_token_bytes(tokenizer)


def _inline(func: Callable[..., Any], args: Sequence[Any]) -> Any:
    return func(*args)


def chat_completion_request(
    chat: Conversation,
    template: ChatTemplate,
    model: LoadedModel,
    *,
    max_prompt_tokens: int,
    chat_max_tokens: int,
    offload: Callable[[Callable[..., Any], Sequence[Any]], Any] = _inline,
    kv_budget_bytes: int | None = None,
    max_logprob_entries: int | None = None,
    tool_call_format: str | None = None,
) -> GenerationInput:
    """Render ``chat``'s conversation, with its tools, and return the generation input it stands for
    (a chat request's, or a Responses request's once its items are messages: the same conversation,
    the same prompt).

    The tools are rendered whatever ``tool_choice`` says (with ``"none"`` the model sees them and
    cannot call them), so ``usage.prompt_tokens`` counts them.

    Args:
        chat: the validated conversation (``wsgi_app.api.chat.Conversation``).
        template: the worker's chat template.
        model: the loaded model (its tokenizer and context length).
        max_prompt_tokens: the longest rendered prompt, tokens (``MAX_PROMPT_TOKENS``).
        chat_max_tokens: the cap on the default ``max_tokens`` (``CHAT_MAX_TOKENS``).
        offload: runs ``func(*args)`` and returns its result: the render and the tokenization go
            through it (a native thread pool's ``apply`` in a worker, so the gevent hub keeps
            serving meanwhile); inline by default.
        kv_budget_bytes: the worker's KV-cache budget (``KV_CACHE_BUDGET_MB``), bytes, or None:
            without ``max_tokens``, the default answer is capped so the request fits it.
        max_logprob_entries: the request's budget of ``logprobs`` entries
            (``MAX_LOGPROB_ENTRIES``), or None (see ``wsgi_app.api.chat.completion_request``).
        tool_call_format: the name of the format a chat template that does not render tools gets
            them written in (``ChatTemplate.render``); None for the template's
            (``ChatTemplate.tool_format``: its own, or ``TOOL_CALL_FORMAT``'s).

    Raises:
        ApiError: 400 naming the conversation (``messages``, ``input``) when the contents are
            longer than any acceptable prompt (:func:`content_char_limit`), the template fails
            (its message) or the rendered prompt is over ``max_prompt_tokens`` or fills the
            context; 400 naming ``max_tokens``, ``max_completion_tokens`` or
            ``max_output_tokens`` when the answer would not fit; 400 ``top_logprobs`` over
            ``max_logprob_entries``.
    """
    prompt_text, prompt_ids = render_conversation(
        chat.messages,
        chat.tools,
        template,
        model,
        max_prompt_tokens=max_prompt_tokens,
        offload=offload,
        tool_call_format=tool_call_format,
        param=chat.messages_param,
    )
    per_token = model.kv_bytes_per_token
    req = completion_request(
        chat,
        prompt_ids,
        prompt_text,
        context_length=model.context_length,
        default_max_tokens=chat_max_tokens,
        template_stop=template.stop,
        kv_tokens_per_choice=(
            kv_budget_bytes // (chat.n * per_token) if kv_budget_bytes and per_token else None
        ),
        max_logprob_entries=max_logprob_entries,
    )
    return generation_input(req, chat.tools, served_tool_format(template, tool_call_format))


def served_tool_format(template: ChatTemplate, name: str | None = None) -> ToolFormat:
    """Return the format calls are written in: the one named ``name``, else the template's."""
    return template.tool_format if name is None else tool_format(name)


def render_conversation(
    messages: Sequence[dict[str, Any]],
    tools: ToolRequest | None,
    template: ChatTemplate,
    model: LoadedModel,
    *,
    max_prompt_tokens: int,
    offload: Callable[[Callable[..., Any], Sequence[Any]], Any] = _inline,
    tool_call_format: str | None = None,
    param: str = "messages",
) -> tuple[str, list[int]]:
    """Render and encode a conversation with its tools (whatever the ``tool_choice``): the prompt
    text and ids of a chat or Messages request, or what a ``count_tokens`` counts.

    Args: as :func:`chat_completion_request`'s (``messages`` the template's messages, ``tools``
    the request's tools or None), and ``param``, the field a refusal names (a Responses request's
    conversation is its ``input``).

    Raises:
        ApiError: 400 naming ``param`` when the contents are longer than any acceptable prompt
            (:func:`content_char_limit`), the template fails (its message) or the rendered prompt
            is over ``max_prompt_tokens``.
    """
    limit = content_char_limit(model.tokenizer, max_prompt_tokens)
    chars = sum(len((m["content"] or "").strip()) for m in messages)  # None: only tool calls
    if chars > limit:
        raise invalid(
            f"The messages hold {chars} characters; no conversation over {limit} characters fits "
            f"the prompt limit of {max_prompt_tokens} tokens.",
            param,
        )
    dicts = [tool.openai() for tool in tools.tools] if tools else None
    try:
        prompt_text, prompt_ids = offload(
            template.render_and_encode, (messages, model.tokenizer, dicts, tool_call_format)
        )
    except TemplateError as exc:
        raise invalid(f"The chat template failed on '{param}': {exc}", param) from None
    if len(prompt_ids) > max_prompt_tokens:
        raise invalid(
            f"The rendered conversation is {len(prompt_ids)} tokens; the limit is "
            f"{max_prompt_tokens}.",
            param,
        )
    return prompt_text, prompt_ids
