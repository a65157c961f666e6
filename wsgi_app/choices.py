"""Turn the engine's token streams into completion choices: text, stop strings, logprobs, usage.

One :class:`Choice` per ``n``; each owns its token stream, its incremental UTF-8 decoder and its stop
matcher. :class:`Completion` drives the choices and renders the OpenAI wire format, either as one JSON
body or as SSE chunks (round-robin over the live choices, one token each).

Source: OpenAI API reference, "Completions" (legacy) objects; DESIGN §4 and §5.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import gevent

from model.engine import GenerationRequest, Step
from model.stop import StopMatcher
from model.tokenizer import ByteTokenizer, TextTokenizer
from model.utf8 import Utf8Decoder
from wsgi_app.errors import json_bytes
from wsgi_app.protocol import CompletionRequest
from wsgi_app.sse import PING, PLAIN, Framing

BYTE_TOKENIZER = ByteTokenizer()


def _dumps(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


# JSON of the short texts most chunks carry (one token releases at most a character or two).
_TEXT_JSON: dict[str, bytes] = {}
_TEXT_JSON_MAX = 4096
# A non-streamed answer up to this size is written in one piece (joining 1 MiB takes ~0.1 ms).
JOIN_LIMIT_BYTES = 1 << 20


def _text_json(text: str) -> bytes:
    """Return ``_dumps(text).encode()``, memoised for texts of up to two characters."""
    encoded = _TEXT_JSON.get(text)
    if encoded is None:
        encoded = _dumps(text).encode()
        if len(text) <= 2 and len(_TEXT_JSON) < _TEXT_JSON_MAX:
            _TEXT_JSON[text] = encoded
    return encoded


class Logprobs:
    """The legacy ``logprobs`` object of one choice: ``tokens``, ``token_logprobs``, ``top_logprobs``,
    ``text_offset`` (character offsets into the choice's text)."""

    __slots__ = ("tokens", "token_logprobs", "top_logprobs", "text_offset", "_token_str")

    def __init__(self, token_str: Callable[[int], str] = BYTE_TOKENIZER.token_str) -> None:
        self._token_str = (
            token_str  # how a token shows: its text, or ``bytes:\\xNN`` for partial UTF-8
        )
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, step: Step, offset: int) -> None:
        """Append one token's entry; ``step`` carries the logprobs the engine computed."""
        token_text = self._token_str
        self.tokens.append(token_text(step.token_id))
        self.token_logprobs.append(step.logprob)
        top = step.top_logprobs
        self.top_logprobs.append(None if top is None else {token_text(t): lp for t, lp in top})
        self.text_offset.append(offset)

    def extend(self, other: Logprobs) -> None:
        """Append ``other``'s entries (shared, read-only ``top_logprobs`` dicts)."""
        self.tokens.extend(other.tokens)
        self.token_logprobs.extend(other.token_logprobs)
        self.top_logprobs.extend(other.top_logprobs)
        self.text_offset.extend(other.text_offset)

    def encode(self, pause: Callable[[], None], slice_len: int = 1024) -> bytes:
        """Return ``json_bytes(self.as_dict())``, encoded a slice of entries at a time with ``pause()``
        between slices, so that a huge answer (echo + logprobs of a long prompt) never holds the hub
        for long."""
        parts = []
        for key in self.__slots__[:4]:
            values = getattr(self, key)
            slices = []
            for start in range(0, len(values), slice_len):
                slices.append(json_bytes(values[start : start + slice_len])[1:-1])
                pause()
            parts.append(b'"%s":[%s]' % (key.encode(), b",".join(slices)))
        return b"{" + b",".join(parts) + b"}"

    def as_dict(self, start: int = 0) -> dict[str, Any]:
        """Return the entries from index ``start`` on, in the wire shape."""
        return {
            "tokens": self.tokens[start:],
            "token_logprobs": self.token_logprobs[start:],
            "top_logprobs": self.top_logprobs[start:],
            "text_offset": self.text_offset[start:],
        }


class Choice:
    """One choice of a completion: advances its token stream one token at a time.

    Args:
        index: the choice's ``index`` on the wire.
        stream: the engine's token stream (closed when the choice ends).
        max_tokens: tokens to generate.
        stop: stop strings (never returned in the text).
        echo_text: the prompt text when ``echo`` is set, else "".
        logprobs: a :class:`Logprobs` to fill, or None.
        token_bytes: the bytes each token id adds to the text (the tokenizer's ``token_bytes``).
    """

    __slots__ = (
        "index",
        "_stream",
        "max_tokens",
        "_decoder",
        "_matcher",
        "parts",
        "tokens",
        "finish_reason",
        "logprobs",
        "_chars",
        "_stops",
        "_token_bytes",
    )

    def __init__(
        self,
        index: int,
        stream: Iterator[Step],
        max_tokens: int,
        stop: tuple[str, ...],
        echo_text: str,
        logprobs: Logprobs | None,
        token_bytes: list[bytes] = BYTE_TOKENIZER.token_bytes,
    ) -> None:
        self.index = index
        self._token_bytes = token_bytes
        self._stream = stream
        self.max_tokens = max_tokens
        self._decoder = Utf8Decoder()
        self._matcher = StopMatcher(stop)
        self._stops = bool(stop)  # without stop strings the matcher releases text unchanged
        self.parts: list[str] = [echo_text] if echo_text else []
        self.tokens = 0
        self.finish_reason: str | None = None if max_tokens > 0 else "length"
        self.logprobs = logprobs
        self._chars = len(echo_text)  # characters decoded so far, for ``text_offset``

    def advance(self) -> str | None:
        """Generate one token and return the text it releases (may be ""), or None for an engine tick
        (no token yet: the engine is still working, e.g. prefilling a long prompt).

        Sets :attr:`finish_reason` on the last token (``length``), on a stop string (``stop``), or
        when the engine ends the stream: an end-of-sequence token (``stop``; it adds no text) or a full
        context (``length``).

        Raises:
            Exception: whatever the engine raises; the caller turns it into an error answer.
        """
        step = next(self._stream)
        if step is None:
            return None
        self.tokens += 1
        ended = step.finish_reason
        text = "" if ended == "stop" else self._decoder.feed(self._token_bytes[step.token_id])
        last = ended is not None or self.tokens >= self.max_tokens
        if last:
            text += self._decoder.finish()
        if self.logprobs is not None:
            self.logprobs.add(step, self._chars)
        self._chars += len(text)
        out, stopped = self._matcher.push(text) if self._stops else (text, False)
        if stopped:
            self.finish_reason = "stop"
            self.close()
        elif last:
            out += self._matcher.flush()
            self.finish_reason = ended or "length"
            self.close()
        self.parts.append(out)
        return out

    def close(self) -> None:
        """Stop the token stream: no model work happens for this choice after this."""
        self._stream.close()


class Completion:
    """The ``n`` choices of one request and their rendering on the wire.

    Args:
        engine: an object with ``stream(GenerationRequest) -> Iterator[Step]`` and
            ``score(prompt_ids, top_n, pause) -> list[Step]`` (logprobs of the prompt tokens, for
            ``echo``; ``pause`` is called between slices of a long prompt).
        req: the validated request.
        seed: the effective seed, 0..2**64-1.
        completion_id: ``cmpl-…``, the same for every chunk.
        created: Unix time in seconds.
        cooperate: called after every token; lets other greenlets run (the engine is inline).
        on_tick: called on an engine tick (no token yet); may raise to end the request (deadline).
        heartbeat_s: while only ticks come, a ``: ping`` is streamed this often, in seconds.
        tokenizer: the model's tokenizer (bytes for the bigram).
        framing: how SSE events are framed (:data:`~wsgi_app.sse.PLAIN` for POST streams,
            :class:`~wsgi_app.sse.EventIds` for the ``EventSource`` stream).
    """

    def __init__(
        self,
        engine: Any,
        req: CompletionRequest,
        seed: int,
        completion_id: str,
        created: int,
        cooperate: Callable[[], None],
        framing: Framing = PLAIN,
        *,
        on_tick: Callable[[], None] | None = None,
        heartbeat_s: float = 15.0,
        tokenizer: TextTokenizer = BYTE_TOKENIZER,
    ) -> None:
        self.req = req
        self._engine = engine
        self._tokenizer = tokenizer
        self._echo_scored = not (req.echo and req.logprobs is not None)
        self.on_tick = on_tick or (lambda: None)
        self.heartbeat_s = heartbeat_s
        self._quiet_since = time.perf_counter()
        self.framing = framing
        self.seed = seed
        self.cooperate = cooperate
        self.choices: list[Choice] = []
        echo_text = req.prompt_text if req.echo else ""
        for i in range(req.n):
            logprobs = None if req.logprobs is None else Logprobs(tokenizer.token_str)
            gen = GenerationRequest(
                prompt_ids=req.prompt_ids,
                max_tokens=req.max_tokens,
                params=req.sampling,
                seed=seed,
                seq=54 + i,
                logprobs=req.logprobs,
                ignore_eos=req.ignore_eos,
            )
            stream = engine.stream(gen)
            self.choices.append(
                Choice(
                    i, stream, req.max_tokens, req.stop, echo_text, logprobs, tokenizer.token_bytes
                )
            )
        head = {"id": completion_id, "object": "text_completion", "created": created}
        self._head = json_bytes(head)[:-1] + b',"model":' + json_bytes(req.model)
        self._usage_tail = b',"usage":null}' if req.include_usage else b"}"
        # The constant bytes around the text of a running chunk without logprobs, so that such a
        # chunk is one join (POST streams also frame it in that join: data_event's bytes).
        self._chunk_mids = [b',"choices":[{"index":%d,"text":' % c.index for c in self.choices]
        self._chunk_tail = b',"logprobs":null,"finish_reason":null}]' + self._usage_tail
        self._plain = framing is PLAIN

    # -- accounting ---------------------------------------------------------------------------

    @property
    def completion_tokens(self) -> int:
        """Tokens generated over all choices."""
        return sum(c.tokens for c in self.choices)

    def usage(self) -> dict[str, int]:
        """Return the ``usage`` object: prompt counted once, completions summed over choices."""
        prompt = len(self.req.prompt_ids)
        completion = self.completion_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def finish_reasons(self) -> list[str | None]:
        """Each choice's finish reason (None while it runs)."""
        return [c.finish_reason for c in self.choices]

    def close(self) -> None:
        """Close every token stream (idempotent)."""
        for choice in self.choices:
            choice.close()

    # -- plain JSON answer ------------------------------------------------------------------------

    def _score_echo(self) -> None:
        """With ``echo`` and ``logprobs``: score the prompt once (after the slot is granted, not at
        admission) and give every choice its prompt entries."""
        if self._echo_scored:
            return
        self._echo_scored = True
        req = self.req
        scored = self._engine.score(req.prompt_ids, req.logprobs, _pause)
        prompt = Logprobs(self._tokenizer.token_str)
        offsets = _offsets(req.prompt_ids, self._tokenizer.token_bytes)
        for i, (offset, step) in enumerate(zip(offsets, scored, strict=True)):
            prompt.add(step, offset)
            if i % 1024 == 1023:
                _pause()
        for choice in self.choices:
            choice.logprobs.extend(prompt)  # C-level list copies: n choices cost one scoring

    def run(self) -> list[bytes]:
        """Generate every choice to its end and return the JSON body (DESIGN §5 key order) as the
        byte strings that, joined, make it: one for an answer up to ``JOIN_LIMIT_BYTES``, else its
        parts, which the server writes one by one (joining a huge answer, echo + logprobs of a long
        prompt, would hold the hub for tens of milliseconds).

        The choices advance round-robin, one token each, so an engine that batches (Llama) has them
        all in flight at once.
        """
        self._score_echo()
        live = [c for c in self.choices if c.finish_reason is None]
        while live:
            for choice in live:
                if choice.advance() is None:
                    self.on_tick()
                else:
                    self.cooperate()
            live = [c for c in live if c.finish_reason is None]
        parts = [self._head, b',"choices":[']
        for c in self.choices:
            logprobs = b"null" if c.logprobs is None else c.logprobs.encode(_pause)
            parts += (
                b'{"index":%d,"text":' % c.index,
                json_bytes("".join(c.parts)),
                b',"logprobs":',
                logprobs,
                b',"finish_reason":',
                json_bytes(c.finish_reason),
                b"},",
            )
        parts[-1] = b"}"  # no comma after the last choice
        parts += (b'],"usage":', json_bytes(self.usage()), b"}")
        # One write for a usual answer (a dozen small writes cost ~0.1 ms of system calls).
        return [b"".join(parts)] if sum(map(len, parts)) <= JOIN_LIMIT_BYTES else parts

    # -- SSE answer -------------------------------------------------------------------------------

    def chunk(self, choice: Choice, text: str, lp_start: int | None) -> bytes:
        """Render one streamed chunk of ``choice`` as an SSE event (b"" when the framing drops it)."""
        if choice.finish_reason is None and (choice.logprobs is None or lp_start is None):
            mid, text_json = self._chunk_mids[choice.index], _text_json(text)
            if self._plain:
                return b"".join((b"data: ", self._head, mid, text_json, self._chunk_tail, b"\n\n"))
            return self.framing.frame(b"".join((self._head, mid, text_json, self._chunk_tail)))
        logprobs = b"null"
        if choice.logprobs is not None and lp_start is not None:
            logprobs = json_bytes(choice.logprobs.as_dict(lp_start))
        finish = (
            b"null" if choice.finish_reason is None else b'"' + choice.finish_reason.encode() + b'"'
        )
        payload = b"".join(
            (
                self._head,
                b',"choices":[{"index":',
                str(choice.index).encode(),
                b',"text":',
                _text_json(text),
                b',"logprobs":',
                logprobs,
                b',"finish_reason":',
                finish,
                b"}]",
                self._usage_tail,
            )
        )
        return self.framing.frame(payload)

    def usage_chunk(self) -> bytes:
        """Render the ``stream_options.include_usage`` chunk: no choices, the usage."""
        return self.framing.frame(
            self._head + b',"choices":[],"usage":' + json_bytes(self.usage()) + b"}"
        )

    def _tick(self) -> Iterator[bytes]:
        """Handle an engine tick: enforce deadlines, and stream a ``: ping`` at most every
        ``heartbeat_s`` (a write: a client that left during a long prefill is noticed)."""
        self.on_tick()
        now = time.perf_counter()
        if now - self._quiet_since >= self.heartbeat_s:
            self._quiet_since = now
            yield PING

    def chunks(self) -> Iterator[bytes]:
        """Yield one SSE event per generated token, round-robin over the live choices.

        With ``echo`` each choice first gets a chunk with the prompt text. The caller frames the stream
        (opening comment, usage chunk, ``[DONE]``) and handles errors. Events the framing drops (a
        resumed ``EventSource`` stream) are generated but not yielded.
        """
        self._score_echo()
        live = list(self.choices)
        if self.req.echo:
            for c in live:
                event = self.chunk(c, self.req.prompt_text, 0 if c.logprobs is not None else None)
                if event:
                    yield event
        if len(live) == 1 and live[0].logprobs is None and self._plain:
            # The common stream (one choice, no logprobs, a POST stream): the same events as the loop
            # below, with the constant parts of every running chunk joined once per request.
            c = live[0]
            advance, cooperate = c.advance, self.cooperate
            head, mid, tail = self._head, self._chunk_mids[0], self._chunk_tail
            while c.finish_reason is None:
                text = advance()
                if text is None:
                    yield from self._tick()
                    continue
                if c.finish_reason is None:
                    yield b"".join((b"data: ", head, mid, _text_json(text), tail, b"\n\n"))
                else:
                    yield self.chunk(c, text, None)
                cooperate()
            return
        while live:
            for c in live:
                if c.finish_reason is not None:
                    continue
                lp_start = len(c.logprobs.tokens) if c.logprobs is not None else None
                text = c.advance()
                if text is None:
                    yield from self._tick()
                    continue
                event = self.chunk(c, text, lp_start)
                if event:
                    yield event
                self.cooperate()
            live = [c for c in live if c.finish_reason is None]


def _pause() -> None:
    gevent.sleep(0)  # let other greenlets (and /healthz) run between slices of a huge answer


def _offsets(prompt_ids: tuple[int, ...], token_bytes: list[bytes]) -> list[int]:
    """Character offset at which each prompt token's text starts (for echoed logprobs)."""
    decoder = Utf8Decoder()
    offsets, chars = [], 0
    for i, token_id in enumerate(prompt_ids):
        offsets.append(chars)
        chars += len(decoder.feed(token_bytes[token_id]))
        if i % 8192 == 8191:
            _pause()
    return offsets
