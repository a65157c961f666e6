"""A completion: the ``n`` choices of one request, and the token loop that generates them.

:meth:`Completion.chunks` is the token loop of every stream: round-robin over the live choices, one token
each, every token's event built by the one chunk builder (``wsgi_app.wire.encoder.ChunkEncoder``) and
followed by a call of the request's pacer (``wsgi_app.generation.pacer.Pacer``). :meth:`Completion.run`
drives the same loop for a non-streamed answer and returns its JSON.

Source: OpenAI API reference, "Completions" (legacy) objects.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from itertools import cycle
from typing import Protocol

from model.engine import Engine, GenerationRequest, GrammarSource
from model.grammar.compile import ConstraintError, MaskViolation
from model.tokenizer import TextTokenizer
from model.utf8 import Utf8Decoder
from wsgi_app.api.completions import Prompt
from wsgi_app.api.errors import ApiError
from wsgi_app.generation.choice import BYTE_TOKENIZER, Choice, TokenTrace, token_start
from wsgi_app.generation.grammars import constraint_failure
from wsgi_app.generation.inputs import GenerationInput
from wsgi_app.generation.pacer import ClientGone
from wsgi_app.generation.tool_calls import ToolChoice
from wsgi_app.wire.encoder import TEXT_COMPLETION, ChunkEncoder, WireFormat
from wsgi_app.wire.logprobs import Logprobs
from wsgi_app.wire.sse import PING, PLAIN, Framing

# The heartbeat of a stream that has no token yet (queued, or its prompt being read), in seconds
# (``HEARTBEAT_S`` when shorter). A client that left is found by the second write after it: the first
# is answered by a reset. In the queue that is within two heartbeats; during a prefill the engine
# ticks every 0.25 s, and a tick that sees the client's end closed writes at once (``Pacer.tick``),
# so within two ticks. Its sequence stops within one engine step after (docs/ARCHITECTURE.md §9).
WAITING_HEARTBEAT_S = 0.5
# How far ahead of its expected place a prompt token's text is looked for, in characters, where the
# tokenizer changed the prompt's text (so the search stays linear in the prompt).
_RESYNC_CHARS = 16


class Pacing(Protocol):
    """The request's pacer (``wsgi_app.generation.pacer.Pacer``): called after every token.

    Raises:
        ApiError: from any method, to end the request (deadline, shutdown).
    """

    def __call__(self) -> None:
        """A token was generated."""

    def tick(self) -> bool:
        """The engine has no token yet; True asks for a write now (the stream's client closed its
        end)."""

    def pause(self) -> None:
        """A slice of a long piece of work (scoring, encoding) is done."""


class Completion:
    """The ``n`` choices of one request and their rendering on the wire.

    Args:
        engine: the model's engine (the choices' token streams, the prompt's scores).
        req: the request's generation input.
        seed: the effective seed, 0..2**64-1.
        completion_id: the id (``cmpl-…``), the same for every chunk.
        created: Unix time in seconds.
        pacer: the request's pacer; called after every token, told about ticks and pauses.
        framing: how SSE events are framed (:data:`~wsgi_app.wire.sse.PLAIN` for POST streams,
            :class:`~wsgi_app.wire.sse.EventIds` for the ``EventSource`` stream).
        heartbeat_s: while only ticks come, a ``: ping`` is streamed this often, in seconds (every
            ``WAITING_HEARTBEAT_S`` at most until the first token).
        tokenizer: the model's tokenizer (bytes for the bigram).
        wire: the wire format of the answer.
        fingerprint: the model version, for wire formats that carry ``system_fingerprint``.
        cache_salt: the prefix-cache salt of every choice (the API key's digest and the request's
            ``cache_salt``; see :class:`model.engine.GenerationRequest`).
        grammar: the output constraint every choice keeps to (``GrammarService.prepare``), or None.
        trace: keep every choice's token ids (:attr:`traces`), for a shadow variant to be
            compared with.
    """

    def __init__(
        self,
        engine: Engine,
        req: GenerationInput,
        seed: int,
        completion_id: str,
        created: int,
        pacer: Pacing,
        framing: Framing = PLAIN,
        *,
        heartbeat_s: float = 15.0,
        tokenizer: TextTokenizer = BYTE_TOKENIZER,
        wire: WireFormat = TEXT_COMPLETION,
        fingerprint: str | None = None,
        cache_salt: str = "",
        grammar: GrammarSource | None = None,
        trace: bool = False,
    ) -> None:
        self.req = req
        self._engine = engine
        self._tokenizer = tokenizer
        self._echo_scored = not (req.echo and req.logprobs is not None)
        self.pacer = pacer
        self.heartbeat_s = heartbeat_s
        self.waiting_heartbeat_s = min(heartbeat_s, WAITING_HEARTBEAT_S)
        self._quiet_since = time.perf_counter()
        self.framing = framing
        self.seed = seed
        self.choices: list[Choice] = []
        # usage.prompt_tokens_details only where there is a prefix cache (the bigram keeps its bytes)
        self._reports_cached = engine.prefix_cache is not None
        self.echo_texts: list[str] = []  # per prompt: the text its choices' echo chunk carries
        # per choice, with ``trace``: the ids its stream gave
        self.traces: list[TokenTrace] | None = [] if trace else None
        n = req.n
        # A request that may call tools (chat: no echo) has choices that read their calls.
        choice_type, calls = Choice, {}
        if req.calls_tools:
            choice_type = ToolChoice
            calls = {"tools": req.tools, "tool_format": req.tool_format, "seed": req.seed}
        if req.reported_stops:
            calls["reported_stops"] = req.reported_stops
        for prompt in req.prompts:
            echo_text, pending = _echo(prompt, req) if req.echo else ("", b"")
            if req.calls_tools:  # a seeded call id derives from its prompt too (``call_id``)
                calls["prompt_ids"] = prompt.ids
            self.echo_texts.append(echo_text)
            for i in range(n):  # choice i of prompt p is index p*n + i, seeded as choice i
                logprobs = None if req.logprobs is None else wire.new_logprobs(tokenizer)
                gen = choice_request(req, prompt, i, seed, grammar, cache_salt)
                stream = engine.stream(gen)
                if self.traces is not None:
                    stream = TokenTrace(stream)
                    self.traces.append(stream)
                choice = choice_type(
                    len(self.choices),
                    stream,
                    req.max_tokens,
                    req.stop,
                    echo_text,
                    logprobs,
                    tokenizer.token_bytes,
                    pending,
                    **calls,
                )
                self.choices.append(choice)
        self.encoder: ChunkEncoder = wire.encoder(
            completion_id,
            created,
            req.model,
            len(self.choices),
            req.include_usage,
            framing,
            fingerprint,
            tool_calls=req.calls_tools,
            prompt_tokens=req.prompt_tokens,
        )

    # -- accounting ---------------------------------------------------------------------------

    @property
    def completion_tokens(self) -> int:
        """Tokens generated over all choices."""
        return sum(c.tokens for c in self.choices)

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens served by the engine's prefix cache, each prompt counted once (its choice
        that reused least); None for an engine without one."""
        if not self._reports_cached:
            return None
        n = self.req.n
        return sum(
            min(c.cached_tokens for c in self.choices[p : p + n])
            for p in range(0, len(self.choices), n)
        )

    def usage(self) -> dict[str, object]:
        """Return the ``usage`` object: each prompt counted once, completions summed over choices;
        ``prompt_tokens_details.cached_tokens`` after them with a prefix cache.

        Source: OpenAI API reference, "The chat completion object" (``usage.prompt_tokens_details``).
        """
        prompt = self.req.prompt_tokens
        completion = self.completion_tokens
        usage: dict[str, object] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        cached = self.cached_tokens
        if cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    def tool_calls(self) -> int | None:
        """Tool calls made over all choices; None for a request that could make none."""
        if not self.req.calls_tools:
            return None
        return sum(len(c.calls) for c in self.choices)

    def finish_reasons(self) -> list[str | None]:
        """Each choice's finish reason (None while it runs)."""
        return [c.finish_reason for c in self.choices]

    def close(self) -> None:
        """Close every token stream (idempotent)."""
        for choice in self.choices:
            choice.close()

    # -- the token loop -----------------------------------------------------------------------

    def _score_echo(self) -> None:
        """With ``echo`` and ``logprobs``: score the prompt once (after the slot is granted, not at
        admission) and give every choice its prompt entries."""
        if self._echo_scored:
            return
        self._echo_scored = True
        req, pause, n = self.req, self.pacer.pause, self.req.n
        for p, prompt in enumerate(req.prompts):
            scored = self._engine.score(prompt.ids, req.logprobs, self._score_checkpoint)
            entries = Logprobs(self._tokenizer.token_str)
            offsets = _offsets(prompt, self._tokenizer.token_bytes, pause)
            for i, (offset, step) in enumerate(zip(offsets, scored, strict=True)):
                entries.add(step, offset)
                if i % 1024 == 1023:
                    pause()
            for choice in self.choices[p * n : (p + 1) * n]:
                choice.logprobs.extend(entries)  # array copies: n choices cost one scoring

    def _score_checkpoint(self) -> None:
        """Between chunks of a prompt's scoring: enforce the deadline and the stop time, and end
        the scoring of a client that left (a long prompt's scoring is minutes of CPU).

        Raises:
            ApiError: as ``Pacer.check``.
            ClientGone: the client closed its end.
        """
        if self.pacer.tick():
            raise ClientGone("client disconnected while its prompt was scored")
        self.pacer.pause()

    def _tick(self) -> Iterator[bytes]:
        """Handle an engine tick: enforce deadlines, and stream a ``: ping`` every
        ``waiting_heartbeat_s`` until the first token (a write: a client that left during a long
        prefill is noticed, and its sequence cancelled), every ``heartbeat_s`` after it, and at
        once when the pacer saw the client's end closed (a client that left answers with a reset,
        and the next write fails)."""
        reset = self.pacer.tick()
        now = time.perf_counter()
        beat_s = self.heartbeat_s if self.completion_tokens else self.waiting_heartbeat_s
        if reset or now - self._quiet_since >= beat_s:
            self._quiet_since = now
            yield PING

    def chunks(self, events: bool = True) -> Iterator[bytes]:
        """Generate every choice to its end: one SSE event per token, round-robin over the live
        choices (so an engine that batches, Llama, has them all in flight at once).

        Each choice may first get an opening chunk (the prompt text with ``echo``; the chat
        completion's role): ``ChunkEncoder.first_chunks``. The caller frames the stream (opening
        comment, usage chunk, ``[DONE]``) and handles errors. Events the framing drops (a
        resumed ``EventSource`` stream) are built but not yielded.

        Args:
            events: False to build no events (a non-streamed answer; only pings are yielded).

        Raises:
            ApiError: 400 naming the output constraint that failed while generating
                (``wsgi_app.generation.grammars.constraint_failure``).
            Exception: whatever else the engine or the pacer raises; the caller answers with an
                error.
        """
        self._score_echo()
        chunk, pace = self.encoder.chunk, self.pacer
        if events:
            n = self.req.n
            echo = [self.echo_texts[c.index // n] for c in self.choices] if self.req.echo else None
            for event in self.encoder.first_chunks(self.choices, echo, self.pacer.pause):
                if event:
                    yield event
        live = [c for c in self.choices if c.finish_reason is None]
        try:
            while live:
                for c in cycle(live):  # round after round, with no per-round work
                    text = c.advance()
                    if text is None:
                        yield from self._tick()
                        continue
                    if events:
                        event = chunk(c, text)
                        if event:
                            yield event
                    pace()
                    if c.finish_reason is not None:
                        break
                # Only the choice that just advanced can have ended: the next round goes on after it.
                k = live.index(c)
                live = live[k + 1 :] + live[:k]
        except MaskViolation:
            raise  # the engine's fault: a 500
        except ConstraintError as exc:  # the constraint's: a 400 naming it (only c.advance raises)
            raise constraint_failure(self.req, c, exc) from exc

    def usage_chunk(self) -> bytes:
        """Return the ``stream_options.include_usage`` event: no choices, the usage."""
        return self.encoder.usage_chunk(self.usage())

    def end_events(self, failure: ApiError | None) -> bytes:
        """Return the stream's last events: its error event when ``failure``, then its end
        (``ChunkEncoder.end_events``); b"" for none."""
        return self.encoder.end_events(failure)

    def run(self) -> list[bytes]:
        """Generate every choice to its end and return the JSON answer's byte strings
        (:meth:`~wsgi_app.wire.encoder.ChunkEncoder.answer`)."""
        for _ in self.chunks(events=False):
            pass
        return self.encoder.answer(self.choices, self.usage(), self.pacer.pause)


def choice_request(
    req: GenerationInput,
    prompt: Prompt,
    i: int,
    seed: int,
    grammar: GrammarSource | None = None,
    cache_salt: str = "",
) -> GenerationRequest:
    """Return what the engine is asked for choice ``i`` of ``prompt`` (its index within the
    prompt's ``n``): the prompt's ids, the request's ``max_tokens`` and sampling, the seed on
    stream ``54 + i`` (so that choice ``i`` draws the same numbers whatever the batch), the
    request's logprobs, ``ignore_eos``, grammar and cache salt. A completion's choices and a shadow
    variant's copies of them are made by this one function.

    Source: docs/ARCHITECTURE.md §6 (sampling and seeds).
    """
    return GenerationRequest(
        prompt_ids=prompt.ids,
        max_tokens=req.max_tokens,
        params=req.sampling,
        seed=seed,
        seq=54 + i,
        logprobs=req.logprobs,
        ignore_eos=req.ignore_eos,
        grammar=grammar,
        cache_salt=cache_salt,
    )


def _echo(prompt: Prompt, req: GenerationInput) -> tuple[str, bytes]:
    """Return the text an echoing choice starts with, and the bytes its decoder starts with.

    Prompt and completion are one byte stream: a token-id prompt ending inside a character (its
    ``tail``) is echoed without that character's U+FFFD, and the tail goes to the choice's decoder,
    which the first generated bytes may complete. With nothing to generate, the U+FFFD stays.
    """
    if prompt.tail and req.max_tokens > 0:
        return prompt.text[:-1], prompt.tail  # text ends with the tail's one U+FFFD
    return prompt.text, b""


def _offsets(prompt: Prompt, token_bytes: list[bytes], pause: Callable[[], None]) -> list[int]:
    """Return the character offset in the echoed prompt at which each prompt token's text starts.

    The echoed text is the string the client sent, which is not always the tokens' own text: a
    SentencePiece tokenizer prepends a space (its dummy prefix, " Once" for "Once"). Offsets count the
    tokens' text and are shifted back by what the tokenizer added in front (never below 0), so that the
    echoed text at ``text_offset[i]`` starts with token ``i``'s text wherever that text is there. A
    tokenizer that changed the text elsewhere (a normalizer) gets each token placed at its text found
    just ahead, when found; offsets never decrease.

    Args:
        prompt: the prompt (its ids and the text echoed).
        token_bytes: the bytes of each token id.
        pause: called between slices of a long prompt.
    """
    decoder = Utf8Decoder()
    pieces, starts = [], []
    for i, token_id in enumerate(prompt.ids):
        held, data = decoder.pending, token_bytes[token_id]
        piece = decoder.feed(data)
        pieces.append(piece)
        starts.append(token_start(piece, data) if held and piece else 0)
        if i % 8192 == 8191:
            pause()
    joined, text = "".join(pieces), prompt.text
    offsets, chars = [], 0
    if text.startswith(joined) or joined.endswith(text):
        shift = max(0, len(joined) - len(text))  # the characters added in front of the text
        for piece, start in zip(pieces, starts, strict=True):
            offsets.append(max(0, chars + start - shift))
            chars += len(piece)
        return offsets
    for piece in pieces:  # the tokens' text differs from the prompt's inside: resynchronise
        if not piece or text.startswith(piece, chars):
            offsets.append(chars)
            chars += len(piece)
            continue
        core = piece.strip()
        found = text.find(core, chars, chars + len(piece) + _RESYNC_CHARS) if core else -1
        offsets.append(chars if found < 0 else found)
        if found >= 0:
            chars = found + len(core)
    return offsets
