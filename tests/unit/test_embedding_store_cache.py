"""The slot-array LRU row cache of the cold tier."""

from __future__ import annotations

import numpy as np

from embedding_server.cache import SLOT_OVERHEAD_BYTES, RowCache

WIDTH = 4
ROW_BYTES = 4 * WIDTH + SLOT_OVERHEAD_BYTES


def rows_of(ids: np.ndarray) -> np.ndarray:
    """Row i is [i, i + 0.25, i + 0.5, i + 0.75]: distinct per id, checkable without the cache."""
    return (ids[:, None] + np.arange(WIDTH) / 4.0).astype(np.float32)


def test_capacity_comes_from_the_byte_bound() -> None:
    cache = RowCache(id_space=100, width=WIDTH, capacity_bytes=10 * ROW_BYTES + ROW_BYTES - 1)
    assert cache.capacity == 10
    cache.put(np.arange(50), rows_of(np.arange(50)))
    assert cache.size == 10 and cache.nbytes <= 11 * ROW_BYTES


def test_hits_return_the_stored_rows_and_count() -> None:
    cache = RowCache(id_space=100, width=WIDTH, capacity_bytes=20 * ROW_BYTES)
    cache.put(np.array([3, 7, 9]), rows_of(np.array([3, 7, 9])))
    rows, hit = cache.get(np.array([9, 4, 3]))
    assert hit.tolist() == [True, False, True]
    assert np.array_equal(rows[[0, 2]], rows_of(np.array([9, 3])))
    assert not rows[1].any()
    assert (cache.hits, cache.misses) == (2, 1) and abs(cache.hit_rate - 2 / 3) < 1e-12


def test_overwrite_updates_in_place() -> None:
    cache = RowCache(id_space=10, width=WIDTH, capacity_bytes=4 * ROW_BYTES)
    cache.put(np.array([1, 2]), rows_of(np.array([1, 2])))
    cache.put(np.array([2]), np.full((1, WIDTH), -5.0, np.float32))
    rows, hit = cache.get(np.array([1, 2]))
    assert hit.all() and cache.size == 2
    assert np.array_equal(rows[0], rows_of(np.array([1]))[0]) and (rows[1] == -5.0).all()


def test_eviction_drops_least_recently_used_first() -> None:
    cap = 16
    cache = RowCache(id_space=1000, width=WIDTH, capacity_bytes=cap * ROW_BYTES)
    old, recent = np.arange(0, 8), np.arange(8, 16)
    cache.put(old, rows_of(old))
    cache.put(recent, rows_of(recent))
    cache.get(old[:4])  # touch half of the old ones: now more recent than `recent`
    newcomers = np.arange(100, 104)
    cache.put(newcomers, rows_of(newcomers))
    # 4 slots were needed; capacity/8 = 2 < 4, so exactly the 4 least recently used
    # (old[4:8], never touched again) are gone.
    _, hit = cache.get(np.concatenate([old, recent, newcomers]))
    assert hit.tolist() == [True] * 4 + [False] * 4 + [True] * 8 + [True] * 4
    rows, _ = cache.get(newcomers)
    assert np.array_equal(rows, rows_of(newcomers))


def test_put_of_more_rows_than_capacity_keeps_the_last() -> None:
    cache = RowCache(id_space=100, width=WIDTH, capacity_bytes=5 * ROW_BYTES)
    ids = np.arange(20, 30)
    cache.put(ids, rows_of(ids))
    rows, hit = cache.get(ids)
    assert hit.tolist() == [False] * 5 + [True] * 5
    assert np.array_equal(rows[5:], rows_of(ids[5:]))


def test_batches_of_eviction_keep_the_cache_consistent() -> None:
    """Random traffic against a dict oracle: every hit returns the row last put."""
    rng = np.random.default_rng(0)
    cache = RowCache(id_space=500, width=WIDTH, capacity_bytes=64 * ROW_BYTES)
    truth: dict[int, float] = {}
    for step in range(200):
        ids = np.unique(rng.integers(0, 500, size=rng.integers(1, 40)))
        rows, hit = cache.get(ids)
        for i, r, h in zip(ids.tolist(), rows, hit):
            if h:
                assert r[0] == truth[i]
        value = float(step)
        cache.put(ids, np.full((len(ids), WIDTH), value, np.float32))
        truth.update({i: value for i in ids.tolist()})
        assert cache.size <= cache.capacity
    # The map and the slot array agree: every cached id maps back to its own slot.
    occupied = cache._ids[cache._ids >= 0]  # noqa: SLF001  (invariant check)
    assert len(occupied) == cache.size and np.array_equal(np.sort(cache._slot_of[occupied]), np.sort(np.flatnonzero(cache._ids >= 0)))


def test_invalidate_and_zero_capacity() -> None:
    cache = RowCache(id_space=10, width=WIDTH, capacity_bytes=4 * ROW_BYTES)
    cache.put(np.array([1, 2]), rows_of(np.array([1, 2])))
    cache.invalidate(np.array([2, 5]))
    _, hit = cache.get(np.array([1, 2]))
    assert hit.tolist() == [True, False] and cache.size == 1
    off = RowCache(id_space=10, width=WIDTH, capacity_bytes=0)
    off.put(np.array([1]), rows_of(np.array([1])))
    _, hit = off.get(np.array([1]))
    assert off.capacity == 0 and not hit.any() and off.misses == 1
