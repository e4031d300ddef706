"""EdfQueue.pop_up_to's whole-queue shortcut (issue 9's lean caller path): a window
that takes every queued item gets them in exactly the order, and with exactly the
bookkeeping, of one heap pop each; dead entries and several classes take the general
path."""

from __future__ import annotations

import numpy as np
import pytest

from recserve.scheduling.queue import EdfQueue
from recserve.scheduling.types import Handle, ItemStatus, Priority, WorkItem


def _fill(seed: int, n: int, classes: tuple[Priority, ...]) -> tuple[EdfQueue, list[Handle]]:
    rng = np.random.default_rng(seed)
    q, handles = EdfQueue(), []
    for seq in range(n):
        deadline = float(rng.integers(0, 5))  # many ties: FIFO by seq among them
        item = WorkItem(f"r{seq}", "default", classes[seq % len(classes)], deadline, float(rng.integers(1, 9)), None)
        h = Handle(item, seq, item.cost, 0.0, 0.0)
        q.push(h, float(seq))
        handles.append(h)
    return q, handles


def _one_pop_each(q: EdfQueue) -> list[Handle]:
    out = []
    while q.peek() is not None:
        h = q.pop()
        h.status = ItemStatus.RUNNING
        out.append(h)
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("classes", [(Priority.STANDARD,), (Priority.CRITICAL, Priority.STANDARD)])
def test_taking_the_whole_queue_matches_one_pop_each(seed: int, classes: tuple[Priority, ...]) -> None:
    fast, _ = _fill(seed, 40, classes)
    slow, _ = _fill(seed, 40, classes)
    got = fast.pop_up_to(float("inf"), True, ItemStatus.RUNNING)
    want = _one_pop_each(slow)
    assert [h.seq for h in got] == [h.seq for h in want]
    assert all(h.status is ItemStatus.RUNNING for h in got)
    assert (fast.count, fast.cost, fast.open_since) == (0, 0.0, None)
    assert fast.peek() is None


def test_a_dead_entry_is_skipped_and_a_cap_is_honoured() -> None:
    q, handles = _fill(7, 20, (Priority.STANDARD,))
    handles[3].status = ItemStatus.CANCELLED
    q.discard(handles[3])
    got = q.pop_up_to(float("inf"), True, ItemStatus.RUNNING)
    assert 3 not in [h.seq for h in got] and len(got) == 19
    q2, _ = _fill(7, 20, (Priority.STANDARD,))
    total = q2.cost
    part = q2.pop_up_to(total - 1.0, True, ItemStatus.RUNNING)  # not everything fits
    assert 0 < len(part) < 20 and sum(h.cost for h in part) <= total - 1.0
    assert q2.count == 20 - len(part)
