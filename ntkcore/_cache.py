"""A bounded least-recently-used cache (plans by shape, unpickled objects on Dask workers)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")
_MISSING = object()


class LRUCache(Generic[V]):
    """At most ``size`` entries; a lookup marks its entry as used, an insertion into a full
    cache drops the entry unused longest.

    Thread-safe: lookups and insertions hold a lock, ``make`` runs outside it (two threads
    missing the same key may both make it; the later insertion wins, both results are
    equal by contract).  Eviction is of single entries, so what a caller used last stays
    cached whatever other callers (other tests, other threads) inserted before.
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        self.size = size
        self._entries: OrderedDict[Hashable, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, make: Callable[[], V]) -> V:
        """The entry of ``key``, made by ``make()`` and inserted when missing."""
        with self._lock:
            value = self._entries.get(key, _MISSING)
            if value is not _MISSING:
                self._entries.move_to_end(key)
                return value  # type: ignore[return-value]
        value = make()
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def keys(self) -> list[Hashable]:
        """The keys, least recently used first."""
        with self._lock:
            return list(self._entries)
