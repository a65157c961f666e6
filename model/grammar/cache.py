"""The compiled grammars a worker keeps: least recently used first out, bounded in bytes.

llguidance's compiled grammar (an ``LLMatcher`` template) reports no size, so each entry is charged
the size its caller estimates (``model.grammar.compile.entry_bytes``, a proxy calibrated against the
RSS an entry keeps: ``bench/grammar_cache.py``). The entries together stay within a budget of bytes,
and an entry estimated over ``entry_max_bytes`` is not kept at all: one very large grammar would
otherwise push out many small ones, and it is compiled again when it is asked for again. Keys are
whatever the caller makes them (``GrammarCompiler``: the tenant's salt and the constraint's
canonical JSON, so one tenant never reuses, nor times, another's compiled grammar).

Source: docs/ARCHITECTURE.md §6 (the compiled grammars and their cache).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager
from typing import Any


class GrammarCache:
    """Values by key, least recently used first out, their estimated sizes within a budget.

    Thread-safe: the compile pool's threads put, the event loop gets.

    Args:
        budget_bytes: most estimated bytes all entries may hold together.
        entry_max_bytes: an entry estimated larger than this is not kept (at most ``budget_bytes``).
        lock: makes the lock of the entries (default ``threading.Lock``; see
            ``model.grammar.compile.GrammarCompiler``).
    """

    def __init__(
        self,
        budget_bytes: int,
        entry_max_bytes: int,
        lock: Callable[[], AbstractContextManager[Any]] = threading.Lock,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.entry_max_bytes = min(entry_max_bytes, budget_bytes)
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = lock()

    def get(self, key: Hashable) -> Any | None:
        """Return the value kept under ``key`` (now the most recently used), or None."""
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                return None
            self._entries.move_to_end(key)
            return found[0]

    def put(self, key: Hashable, value: Any, size_bytes: int) -> bool:
        """Keep ``value`` under ``key``, charged ``size_bytes``, evicting the least recently used
        entries to stay within the budget; return False (keeping nothing) when ``size_bytes`` is
        over ``entry_max_bytes``."""
        if size_bytes > self.entry_max_bytes:
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[key] = (value, size_bytes)
            self._bytes += size_bytes
            while self._bytes > self.budget_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= evicted
        return True

    @property
    def bytes(self) -> int:
        """Estimated bytes the entries hold together."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)
