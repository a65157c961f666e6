"""One choice's grammar state, and the token masks sampling applies.

A :class:`TokenMatcher` follows the tokens of one choice. Before each token the engine asks for the
ids the grammar allows (:meth:`TokenMatcher.allowed`, :func:`allowed_rows` for every constrained
sequence of a Llama step on the engine thread, or :meth:`TokenMatcher.next_mask`, which computes it
on the matcher's ``offload`` thread: the bigram's, whose own loop runs on the gevent hub; llguidance
drops the GIL meanwhile); ``model.sampling`` gives every other id a logit of ``-inf`` together with
``logit_bias`` and the penalties. After the token,
:meth:`TokenMatcher.consume` advances the grammar and says whether it is complete (nothing more can
follow: the choice ends with ``finish_reason "stop"``). A matcher in llguidance's error state raises
:class:`ConstraintError`: the choice ends with an error, never with text the grammar did not allow.

Every mask is charged to its request: the CPU seconds of the thread that computed it
(``time.thread_time``: what the mask cost, whatever else the machine ran meanwhile) go to the
matcher's ``mask_s`` and its request's :class:`MaskBudget`, which bounds one mask and all the
request's masks together; past either bound the matcher raises :class:`MaskTooCostly`, so one costly
constraint ends its own request instead of slowing every stream of the worker. (A mask cannot be
interrupted: the bound is checked once it is computed, so the one that crosses it is the last.)

Source: llguidance ``LLMatcher`` and ``llguidance.numpy`` (python/llguidance/_lib.pyi, numpy.py);
docs/ARCHITECTURE.md §6 (where the mask sits).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import llguidance
import llguidance.numpy as llnp
import numpy as np

# Runs a function on another native thread: returns at once a waiter that gives its result (or
# raises its exception) when called. The serving layer gives the bigram's matchers one.
Offload = Callable[[Callable[[], Any]], Callable[[], Any]]
_SPIN_BLOCK = bytes(1 << 18)  # hashed by the mask_spin_s fault: ~0.5 ms a block, the GIL released


class ConstraintError(ValueError):
    """A constraint that cannot be enforced exactly; the message is short and echoes no state.

    Raised while generating, it is the constraint's doing: its grammar allows no next token (it has
    no finite completion from here, or llguidance's parser limits ran out), or refused a token its
    own mask allowed. :class:`MaskViolation` is the other case."""


class MaskTooCostly(ConstraintError):
    """A constraint whose token masks cost more than its request may spend on them: one mask over
    :attr:`MaskBudget.token_s`, or the request's masks together over :attr:`MaskBudget.request_s`.

    Attributes:
        limit: ``"token"`` or ``"request"``: the bound that was crossed.
    """

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


class MaskBudget:
    """The CPU time one request's token masks may take: each mask, and all of them together.

    Charged on the thread that consumes the masks (the Llama engine thread, or the request's
    greenlet for the bigram), so it needs no lock.

    Args:
        token_s: most CPU seconds one mask may take.
        request_s: most CPU seconds the request's masks may take together, over all its choices.

    Attributes:
        spent_s: CPU seconds charged so far.
        crossed: the bound crossed, once one is: the request's other choices compute no more
            masks (so a request pays for one mask over the bound, not one per choice).
    """

    __slots__ = ("token_s", "request_s", "spent_s", "crossed")

    def __init__(self, token_s: float = float("inf"), request_s: float = float("inf")) -> None:
        self.token_s = token_s
        self.request_s = request_s
        self.spent_s = 0.0
        self.crossed: MaskTooCostly | None = None

    def charge(self, seconds: float) -> None:
        """Add one mask's CPU ``seconds``.

        Raises:
            MaskTooCostly: the mask took more than :attr:`token_s`, or the request's masks now
                total more than :attr:`request_s`.
        """
        self.spent_s += seconds
        if seconds > self.token_s:
            self.crossed = MaskTooCostly(
                f"its token masks cost too much: one took {seconds * 1e3:.1f} ms of CPU, over the "
                f"limit of {self.token_s * 1e3:g} ms a token",
                "token",
            )
        elif self.spent_s > self.request_s:
            self.crossed = MaskTooCostly(
                f"its token masks cost too much: they took {self.spent_s:.2f} s of CPU, over the "
                f"limit of {self.request_s:g} s a request",
                "request",
            )
        if self.crossed is not None:
            raise self.crossed


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
        budget: the request's mask budget (shared by its choices); None for no bound.
        offload: where :meth:`next_mask` computes masks (:data:`Offload`); None for the caller's
            thread.

    Attributes:
        tokens: tokens consumed so far.
        mask_s: CPU seconds spent computing this choice's masks, summed.
        fault_at: test hook (``GREENSERVE_FAULTS`` ``matcher_fail_at``): the token number, counted
            from 1, at which a token the grammar forbids is fed, so llguidance enters its error state;
            0 for never.
        spin_s: test hook (``GREENSERVE_FAULTS`` ``mask_spin_s``): CPU seconds every mask also
            spins where it is computed (a costly grammar's mask without the grammar); 0 for none.
    """

    __slots__ = (
        "_m", "vocab_size", "tokens", "mask_s", "fault_at", "spin_s", "budget", "offload",
        "_words", "_row", "_costly",
    )  # fmt: skip

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        vocab_size: int,
        bridge_size: int,
        budget: MaskBudget | None = None,
        offload: Offload | None = None,
    ) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self.tokens = 0
        self.mask_s = 0.0
        self.fault_at = 0
        self.spin_s = 0.0
        self.budget = budget
        self.offload = offload
        self._words = _words(bridge_size)
        self._row: np.ndarray | None = None  # the last mask handed out (:meth:`check`)
        self._costly: MaskTooCostly | None = None  # the bound its masks crossed (:meth:`check`)

    def allowed(self) -> np.ndarray:
        """Return the `(vocab_size,)` bool mask of the ids the grammar allows next, computed here.

        Raises:
            ConstraintError: the matcher is in an error state, or allows no id of the model.
            MaskTooCostly: the mask crossed the request's budget.
        """
        if self._over():
            raise self._costly
        return self._charged(*self._compute())

    def next_mask(self) -> Callable[[], np.ndarray]:
        """Start computing the next mask on :attr:`offload` (here when there is none) and return
        a function that waits for it and returns :meth:`allowed`'s row (raising what it raises).

        The matcher must not be used meanwhile: the caller consumes no token before the wait.
        """
        if self._over():
            return self.allowed  # raises at once: the request's masks are over its budget
        if self.offload is None:
            done = self._compute()
            return lambda: self._charged(*done)
        wait = self.offload(self._compute)
        return lambda: self._charged(*wait())

    def _over(self) -> bool:
        """Whether the request's budget is already crossed (by this choice or another): then
        its masks are not computed any more, and :meth:`check` raises the crossed bound."""
        if self._costly is None and self.budget is not None:
            self._costly = self.budget.crossed
        return self._costly is not None

    def _compute(self) -> tuple[np.ndarray, float]:
        """Return the next mask's `(1, words)` int32 bitmask and the CPU seconds it took on this
        thread (any thread: it touches nothing but the llguidance matcher)."""
        bitmask = np.full((1, self._words), -1, np.int32)
        return bitmask, self._fill(bitmask, 0)

    def _fill(self, bitmask: np.ndarray, row: int) -> float:
        """Write the next mask into ``bitmask[row]``; return the CPU seconds it took here."""
        start = time.thread_time()
        llnp.fill_next_token_bitmask(self._m, bitmask, row)
        while time.thread_time() - start < self.spin_s:  # the mask_spin_s fault
            hashlib.sha256(_SPIN_BLOCK)  # CPU without the GIL, as llguidance's masks run
        return time.thread_time() - start

    def _charged(self, bitmask: np.ndarray, cpu_s: float) -> np.ndarray:
        """Charge a computed mask's ``cpu_s`` and return its usable row (:meth:`check`)."""
        self.charge(cpu_s)
        return self.check(_rows(bitmask, self.vocab_size)[0])

    def charge(self, cpu_s: float) -> None:
        """Add one mask's CPU seconds to :attr:`mask_s` and to the request's budget; a crossed
        bound is raised by :meth:`check` (after the grammar's own failure, if any: a mask that
        finds no output possible may take long to find it)."""
        self.mask_s += cpu_s
        if self.budget is not None and self._costly is None:
            try:
                self.budget.charge(cpu_s)
            except MaskTooCostly as exc:
                self._costly = exc

    def error(self) -> str:
        """Return llguidance's error message (one line, no grammar state), or "" when none."""
        return " ".join((self._m.get_error() or "").split())[:300] if self._m.is_error() else ""

    def check(self, row: np.ndarray) -> np.ndarray:
        """Return ``row`` (this matcher's allowed ids) once it is known to be usable.

        Raises:
            ConstraintError: the matcher is in an error state, or ``row`` allows no id of the model.
            MaskTooCostly: a mask crossed the request's budget.
        """
        if self._m.is_error():
            raise ConstraintError(reason(self._m.get_error() or ""))
        if not row.any():
            raise ConstraintError("the output constraint allows no token of this model here")
        if self._costly is not None:
            raise self._costly
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
    """Return each matcher's allowed ids, each computed here (llguidance drops the GIL) and
    charged to its own request.

    Args:
        matchers: the constrained sequences of one step, all over one tokenizer.

    Returns:
        One `(vocab_size,)` bool row per matcher, in order.

    A matcher in an error state, or whose mask crossed its request's budget, is not raised here:
    each caller runs :meth:`TokenMatcher.check` on its own row, so one failed grammar ends one
    choice, not the step.

    One call per matcher, not llguidance's ``fill_next_token_bitmask_par`` (which spreads a batch
    over an ``LLExecutor``'s threads): a worker has one core to give, and only a mask computed on
    this thread can be timed by this thread's CPU clock and charged to its own request.
    """
    if not matchers:
        return []
    bitmask = np.full((len(matchers), matchers[0]._words), -1, np.int32)
    for i, m in enumerate(matchers):
        if not m._over():  # a crossed bound is raised by its check
            m.charge(m._fill(bitmask, i))
    return list(_rows(bitmask, matchers[0].vocab_size))
