"""ntkcore._cache.LRUCache: made once, bounded, least recently used evicted first."""

from __future__ import annotations

import threading

import pytest

from ntkcore._cache import LRUCache


def test_makes_once_and_evicts_the_least_recently_used():
    cache: LRUCache[int] = LRUCache(3)
    made: list[int] = []

    def get(key: int) -> int:
        return cache.get(key, lambda: made.append(key) or key * 10)

    assert [get(k) for k in (0, 1, 2)] == [0, 10, 20]
    assert get(0) == 0 and made == [0, 1, 2]  # a hit; 0 is now the most recently used
    assert get(3) == 30 and cache.keys() == [2, 0, 3]  # 1 was used longest ago
    assert get(1) == 10 and made == [0, 1, 2, 3, 1] and cache.keys() == [0, 3, 1]
    assert len(cache) == 3 and 0 in cache and 2 not in cache
    cache.clear()
    assert len(cache) == 0


def test_a_key_used_last_survives_other_insertions():
    """The failure this class replaced: a cache cleared when full dropped the entry a caller
    had just used, so whether a plan was reused depended on what other tests planned."""
    cache: LRUCache[str] = LRUCache(4)
    cache.get("mine", lambda: "plan")
    for k in range(50):
        cache.get(k, lambda: "other")
        cache.get("mine", lambda: pytest.fail("'mine' was evicted"))


def test_threads_share_one_bounded_cache():
    cache: LRUCache[int] = LRUCache(8)
    errors: list[BaseException] = []

    def work(offset: int) -> None:
        try:
            for k in range(500):
                key = (k + offset) % 20
                assert cache.get(key, lambda key=key: key * 2) == key * 2
                assert len(cache) <= 8
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(cache) == 8


def test_size_must_be_positive():
    with pytest.raises(ValueError, match="size"):
        LRUCache(0)
