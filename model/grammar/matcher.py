"""One choice's grammar state, and the token masks sampling applies.

A :class:`TokenMatcher` follows the tokens of one choice. Before each token the engine asks for the
ids the grammar allows (:meth:`TokenMatcher.allowed`, or :func:`allowed_rows` for every constrained
sequence of a Llama step in one llguidance call, which drops the GIL); ``model.sampling`` gives every
other id a logit of ``-inf`` together with ``logit_bias`` and the penalties. After the token,
:meth:`TokenMatcher.consume` advances the grammar and says whether it is complete (nothing more can
follow: the choice ends with ``finish_reason "stop"``). A matcher in llguidance's error state raises
:class:`ConstraintError`: the choice ends with an error, never with text the grammar did not allow.

Source: llguidance ``LLMatcher`` and ``llguidance.numpy`` (python/llguidance/_lib.pyi, numpy.py);
docs/ARCHITECTURE.md §6 (where the mask sits).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import llguidance
import llguidance.numpy as llnp
import numpy as np

_executor: llguidance.LLExecutor | None = None


class ConstraintError(ValueError):
    """A constraint that cannot be enforced exactly; the message is short and echoes no state.

    Raised while generating, it is the constraint's doing: its grammar allows no next token (it has
    no finite completion from here, or llguidance's parser limits ran out), or refused a token its
    own mask allowed. :class:`MaskViolation` is the other case."""


class MaskViolation(ConstraintError):
    """A token the last mask forbade was fed to the matcher: the engine's fault, not the
    constraint's (only allowed tokens are ever sampled; the ``matcher_fail_at`` fault feeds one)."""


NO_OUTPUT = "no output can match it"
PAST_LIMITS = "it is past llguidance's parser limits"
# How llguidance's messages of a parser limit begin or read (parser/src/earley/parser.rs,
# regexvec.rs, grammar_builder.rs): items in an Earley row or step, lexer states and fuel, grammar
# size. verbose_errors off, each ends with "<non-verbose/>".
_LIMIT_WORDS = (
    "Current row has",
    "Too many items",
    "too many expressions",
    "too many states",
    "lexer precomputation failed",
    "too big (limit",
)


def reason(error: str) -> str:
    """Return llguidance's error message ``error`` as a refusal's reason, on one line: an empty
    mask (``NoExtensionBias``, or no message) is :data:`NO_OUTPUT`; a parser limit says so
    (:data:`PAST_LIMITS`, then llguidance's words: the constraint may have outputs, too costly to
    follow); any other message is llguidance's.

    Source: llguidance parser/src/tokenparser.rs (``augment_err``) and the limits' messages.
    """
    text = " ".join(error.replace("<non-verbose/>", " ").split())
    if text in ("", "NoExtensionBias"):
        return NO_OUTPUT
    if any(words in text for words in _LIMIT_WORDS):
        if "ff_tokens" in text:  # the forced-output walk: llguidance's advice does not apply
            text = text.split("; try ")[0] + ": the output forced from here is too long, or endless"
        return f"{PAST_LIMITS} ({text})"
    return text


def _words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def _rows(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """Return `(batch, vocab_size)` bool rows of a `(batch, words)` int32 bitmask (bit i of word w is
    id 32 w + i, little-endian, as llguidance writes it)."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab_size].view(bool)


class TokenMatcher:
    """The grammar state of one choice.

    Args:
        matcher: a fresh ``llguidance.LLMatcher`` (a copy of a compiled grammar's template).
        vocab_size: the model's vocabulary: ids the logits cover.
        bridge_size: the llguidance tokenizer's vocabulary (one more id for the byte tokenizer's
            end marker, which is never sampled; see ``model.grammar.tokens``).

    Attributes:
        tokens: tokens consumed so far.
        mask_s: seconds spent computing this choice's masks, summed.
        fault_at: test hook (``GREENSERVE_FAULTS`` ``matcher_fail_at``): the token number, counted
            from 1, at which a token the grammar forbids is fed, so llguidance enters its error state;
            0 for never.
    """

    __slots__ = ("_m", "vocab_size", "tokens", "mask_s", "fault_at", "_words", "_row")

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, bridge_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self.tokens = 0
        self.mask_s = 0.0
        self.fault_at = 0
        self._words = _words(bridge_size)
        self._row: np.ndarray | None = None  # the last mask handed out (:meth:`check`)

    def allowed(self) -> np.ndarray:
        """Return the `(vocab_size,)` bool mask of the ids the grammar allows next.

        Raises:
            ConstraintError: the matcher is in an error state, or allows no id of the model.
        """
        start = time.perf_counter()
        bitmask = np.full((1, self._words), -1, np.int32)
        llnp.fill_next_token_bitmask(self._m, bitmask)
        self.mask_s += time.perf_counter() - start
        return self.check(_rows(bitmask, self.vocab_size)[0])

    def error(self) -> str:
        """Return llguidance's error message (one line, no grammar state), or "" when none."""
        return " ".join((self._m.get_error() or "").split())[:300] if self._m.is_error() else ""

    def check(self, row: np.ndarray) -> np.ndarray:
        """Return ``row`` (this matcher's allowed ids) once it is known to be usable.

        Raises:
            ConstraintError: the matcher is in an error state, or ``row`` allows no id of the model.
        """
        if self._m.is_error():
            raise ConstraintError(reason(self._m.get_error() or ""))
        if not row.any():
            raise ConstraintError("the output constraint allows no token of this model here")
        self._row = row
        return row

    def consume(self, token_id: int) -> bool:
        """Advance past ``token_id``; return True when the grammar is complete (nothing can follow).

        Raises:
            MaskViolation: the last mask (:meth:`check`) forbade ``token_id``.
            ConstraintError: llguidance refused a token its mask allowed, or is in an error state.
        """
        self.tokens += 1
        if self.tokens == self.fault_at:
            token_id = self._forbidden()
        if not self._m.consume_token(token_id) or self._m.is_error():
            row = self._row
            if row is not None and not (0 <= token_id < len(row) and row[token_id]):
                raise MaskViolation("a token the output constraint forbids was fed to it")
            raise ConstraintError(reason(self._m.get_error() or ""))
        return self._m.is_stopped()

    def forced(self) -> list[int]:
        """Return the tokens every output the grammar allows goes on with from here (llguidance's
        fast-forward tokens; empty where there is a choice, or the grammar is complete)."""
        return self._m.compute_ff_tokens()

    def _forbidden(self) -> int:
        bitmask = np.full((1, self._words), -1, np.int32)
        llnp.fill_next_token_bitmask(self._m, bitmask)
        return int(np.flatnonzero(~_rows(bitmask, self.vocab_size)[0])[0])

    @property
    def accepting(self) -> bool:
        """Whether the text so far satisfies the grammar (it may still be extended)."""
        return self._m.is_accepting()


def allowed_rows(matchers: Sequence[TokenMatcher]) -> list[np.ndarray]:
    """Return each matcher's allowed ids, computed in one llguidance call (GIL released).

    Args:
        matchers: the constrained sequences of one step, all over one tokenizer.

    Returns:
        One `(vocab_size,)` bool row per matcher, in order.

    A matcher in an error state is not raised here: each caller runs :meth:`TokenMatcher.check`
    on its own row, so one failed grammar ends one choice, not the step.
    """
    global _executor
    if not matchers:
        return []
    if _executor is None:
        _executor = llguidance.LLExecutor(num_threads=1)  # one core per worker: no thread fan-out
    start = time.perf_counter()
    bitmask = np.full((len(matchers), matchers[0]._words), -1, np.int32)
    llnp.fill_next_token_bitmask_par(
        _executor, [(m._m, i) for i, m in enumerate(matchers)], bitmask
    )
    rows = _rows(bitmask, matchers[0].vocab_size)
    share = (time.perf_counter() - start) / len(matchers)
    for m in matchers:
        m.mask_s += share
    return list(rows)
