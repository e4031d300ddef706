"""The earliest-deadline-first queue with priority classes and lazy deletion.

One binary heap per priority class, ordered by ``(deadline, seq)``: higher classes are
served first, earliest deadline first within a class, FIFO among equal deadlines.
Cancelling a queued item only marks it (O(1)); dead entries are skipped when they reach
a heap's head and the heaps are compacted when dead entries outnumber live ones, so the
cost stays amortised O(log n) per item with no O(n) scan per add or cancel.

Because each heap is deadline-ordered, expired items are always at the heads: dropping
them costs O(expired · log n), never a scan.
"""

from __future__ import annotations

import heapq
import math
from typing import Iterator

from recserve.scheduling.types import Handle, ItemStatus, Priority

_Entry = tuple[float, int, Handle]  # (deadline monotonic s, seq, handle)

_NUM_CLASSES = len(Priority)
_COMPACT_MIN_DEAD = 64


class EdfQueue:
    """Queued handles by priority class, then deadline. A handle is live while its status
    is QUEUED; anything else found in a heap is a dead entry."""

    __slots__ = ("_heaps", "_dead", "count", "cost", "open_since")

    def __init__(self) -> None:
        self._heaps: list[list[_Entry]] = [[] for _ in range(_NUM_CLASSES)]
        self._dead = 0
        self.count = 0  # live queued items
        self.cost = 0.0  # sum of live queued items' cost
        # When the current batch-formation window opened: the enqueue time of the first
        # item into an empty queue (see Scheduler for how leftovers reset it); None if empty.
        self.open_since: float | None = None

    def push(self, handle: Handle, now: float) -> None:
        """Enqueue a handle whose status the caller has set to QUEUED."""
        heapq.heappush(self._heaps[handle.item.priority], (handle.item.deadline, handle.seq, handle))
        if self.count == 0:
            self.open_since = now
        self.count += 1
        self.cost += handle.cost

    def discard(self, handle: Handle) -> None:
        """Account for a live queued handle that the caller has just marked non-QUEUED
        (cancelled / dropped): its heap entry becomes dead and is skipped later."""
        self.count -= 1
        self.cost -= handle.cost
        self._dead += 1
        if self.count == 0:
            self.cost = 0.0  # no float drift once empty
            self.open_since = None
        if self._dead > _COMPACT_MIN_DEAD and self._dead > self.count:
            self._compact()

    def peek(self) -> Handle | None:
        """The next live handle in (class, deadline, seq) order, or None."""
        for heap in self._heaps:
            while heap:
                handle = heap[0][2]
                if handle.status is ItemStatus.QUEUED:
                    return handle
                heapq.heappop(heap)
                self._dead -= 1
        return None

    def pop(self) -> Handle:
        """Remove and return the next live handle; the caller sets its new status.
        Raises IndexError when empty."""
        for heap in self._heaps:
            while heap:
                handle = heapq.heappop(heap)[2]
                if handle.status is ItemStatus.QUEUED:
                    self.count -= 1
                    self.cost -= handle.cost
                    if self.count == 0:
                        self.cost = 0.0
                        self.open_since = None
                    return handle
                self._dead -= 1
        raise IndexError("pop from an empty EdfQueue")

    def pop_up_to(self, max_cost: float, first_free: bool, new_status: ItemStatus) -> list[Handle]:
        """Pop live handles in order while their summed cost stays <= ``max_cost``; with
        ``first_free`` the first one is popped whatever its cost. Popped handles get
        ``new_status``. The bulk form of peek + pop for batch formation."""
        if self._dead == 0 and self.cost <= max_cost and self.count:
            whole = self._take_all(new_status)  # everything fits: no heap pops
            if whole is not None:
                return whole
        out: list[Handle] = []
        total = 0.0
        for heap in self._heaps:
            while heap:
                handle = heap[0][2]
                if handle.status is not ItemStatus.QUEUED:
                    heapq.heappop(heap)
                    self._dead -= 1
                    continue
                if total + handle.cost > max_cost and (out or not first_free):
                    break
                heapq.heappop(heap)
                handle.status = new_status
                out.append(handle)
                total += handle.cost
            else:
                continue
            break  # stopped on a head that does not fit: lower classes wait too
        if out:
            self.count -= len(out)
            self.cost -= total
            if self.count == 0:
                self.cost = 0.0
                self.open_since = None
        return out

    def _take_all(self, new_status: ItemStatus) -> list[Handle] | None:
        """Every queued handle, in (deadline, seq) order, when one class holds them all
        and none is dead (the common case of a window that takes its whole queue): one
        sort instead of a heap pop each. None otherwise."""
        live = [heap for heap in self._heaps if heap]
        if len(live) != 1:
            return None
        heap = live[0]
        heap.sort()  # (deadline, seq) are unique: handles are never compared
        out = [entry[2] for entry in heap]
        heap.clear()
        for handle in out:
            handle.status = new_status
        self.count = 0
        self.cost = 0.0
        self.open_since = None
        return out

    def pop_expired(self, now: float) -> Handle | None:
        """Remove and return one live handle whose deadline is <= now, or None."""
        for heap in self._heaps:
            while heap:
                deadline, _, handle = heap[0]
                if handle.status is not ItemStatus.QUEUED:
                    heapq.heappop(heap)
                    self._dead -= 1
                    continue
                if deadline > now:
                    break
                heapq.heappop(heap)
                self.count -= 1
                self.cost -= handle.cost
                if self.count == 0:
                    self.cost = 0.0
                    self.open_since = None
                return handle
        return None

    def earliest_deadline(self) -> float:
        """Minimum deadline over live queued handles (math.inf when empty)."""
        best = math.inf
        for heap in self._heaps:
            while heap and heap[0][2].status is not ItemStatus.QUEUED:
                heapq.heappop(heap)
                self._dead -= 1
            if heap and heap[0][0] < best:
                best = heap[0][0]
        return best

    def adjust_cost(self, delta: float) -> None:
        """A live queued handle's cost changed by ``delta``."""
        self.cost += delta

    def __iter__(self) -> Iterator[Handle]:
        """Live handles in no particular order (for abort / inspection, not the hot path)."""
        for heap in self._heaps:
            for _, _, handle in heap:
                if handle.status is ItemStatus.QUEUED:
                    yield handle

    def _compact(self) -> None:
        for i, heap in enumerate(self._heaps):
            live = [e for e in heap if e[2].status is ItemStatus.QUEUED]
            heapq.heapify(live)
            self._heaps[i] = live
        self._dead = 0
