"""Shared types of the scheduler core: work items, handles, batches and outcomes.

A caller builds a :class:`WorkItem` and hands it to ``Scheduler.add``, which returns a
:class:`Handle` — the scheduler's record of that item for its whole life. The runner
receives a :class:`Batch` of handles and answers with one :class:`Outcome` per handle:

- :class:`Done` — the item is finished; ``output`` resolves the caller's result;
- :class:`Continue` — the item stays for a later step (decode iterations); its
  ``partial_output`` goes to the caller's stream and its cost may change;
- :class:`Preempted` — the item goes back to the queue, keeping ``state``;
- :class:`Failed` — that item alone fails with ``error``; the rest of its batch goes on
  (one bad decode sequence must not take its neighbours down).

Early per-item resolution. A runner that learns one item's result before the whole
batch is finished (the lookup client, as each caller's rows arrive) calls
``Scheduler.resolve(handle, Done(output) | Failed(error), now)`` while the batch still
runs. The caller is answered at once; the item becomes terminal, and the batch's later
``complete`` (or ``fail``) skips it: whatever outcome it returns for that item is
ignored, and the item's quota and policy resources are released only then, because the
runner may still be using them. So the whole vocabulary is::

    outcome at complete      early, while running      effect
    Done(output)             resolve(h, Done(output))  caller gets output       (terminal)
    Failed(error)            resolve(h, Failed(error)) caller gets error        (terminal)
    Continue(...)            —                         stays for the next step
    Preempted(state)         —                         back to the queue

Everything here uses ``__slots__`` dataclasses: one handle per request is on the hot
path and the core's budget is a few microseconds per item.
"""

from __future__ import annotations

import dataclasses
import math
import enum
from typing import Any, Protocol, Sequence, Union

from recserve.errors import InvalidArgument, RecserveError


class Priority(enum.IntEnum):
    """Priority class. Lower value = scheduled first; the value indexes the queues."""

    CRITICAL = 0
    STANDARD = 1
    BEST_EFFORT = 2

    @classmethod
    def parse(cls, value: "Priority | str | int") -> "Priority":
        """Accept a Priority, its name ("critical", "standard", "best_effort") or its value."""
        if isinstance(value, Priority):
            return value
        if isinstance(value, str):
            found = _PRIORITY_BY_NAME.get(value.lower())
            if found is None:
                raise InvalidArgument(f"priority {value!r} is not one of {sorted(_PRIORITY_BY_NAME)}")
            return found
        try:
            return cls(value)
        except ValueError:
            raise InvalidArgument(f"priority {value!r} is not one of {[int(p) for p in cls]}") from None


_PRIORITY_BY_NAME = {"critical": Priority.CRITICAL, "standard": Priority.STANDARD, "best_effort": Priority.BEST_EFFORT}


class ItemStatus(enum.Enum):
    """Where an item is in its life. Terminal: DONE, FAILED, DROPPED, CANCELLED."""

    QUEUED = "queued"  # waiting in the EDF queue
    RUNNING = "running"  # inside a batch handed to the runner
    RESIDENT = "resident"  # returned Continue; waits for its next step outside the queue
    DONE = "done"
    FAILED = "failed"
    DROPPED = "dropped"  # deadline passed before it ran
    CANCELLED = "cancelled"


TERMINAL = frozenset({ItemStatus.DONE, ItemStatus.FAILED, ItemStatus.DROPPED, ItemStatus.CANCELLED})
_ItemDone, _ItemFailed, _ItemDropped, _ItemCancelled = ItemStatus.DONE, ItemStatus.FAILED, ItemStatus.DROPPED, ItemStatus.CANCELLED


@dataclasses.dataclass(slots=True)
class WorkItem:
    """One unit of work as the caller describes it.

    ``deadline`` is monotonic seconds (``math.inf`` for none). ``cost`` is policy-defined:
    candidates for a ranker batch, ids for a lookup window, tokens for decode. ``payload``
    is opaque to the scheduler and reaches the runner untouched. ``min_service_s`` is the
    least service time the caller knows the item needs to be worth running; the slack
    check at admission uses it when it exceeds the measured estimate (the cascade: an
    undegraded call's cost, which degraded calls' short measured times understate).
    """

    request_id: str
    tenant: str
    priority: Priority
    deadline: float
    cost: float
    payload: Any = None
    min_service_s: float = 0.0


class ItemListener(Protocol):
    """Receives an item's results. Called synchronously by the core on the caller's thread
    (the ServingLoop's event loop), so implementations must not block."""

    def on_partial(self, handle: "Handle", output: Any) -> None: ...

    def on_done(self, handle: "Handle", output: Any) -> None: ...

    def on_error(self, handle: "Handle", error: RecserveError) -> None: ...


@dataclasses.dataclass(slots=True, eq=False)
class Handle:
    """The scheduler's record of one admitted item; returned by ``Scheduler.add``.

    Read-only for everyone but the core, except ``state`` (owned by the runner: e.g. decode
    progress carried across steps and preemptions) and ``policy_data`` (owned by the policy:
    e.g. the KV blocks it reserved for the item).
    """

    item: WorkItem
    seq: int  # admission order; breaks deadline ties FIFO
    cost: float  # current cost (Continue / set_cost may change it)
    arrived_at: float  # monotonic s of add
    enqueued_at: float  # monotonic s of the latest entry into the queue
    listener: ItemListener | None = None
    status: ItemStatus = ItemStatus.QUEUED
    state: Any = None
    policy_data: Any = None
    output: Any = None  # the Done output, once finished
    error: RecserveError | None = None  # the terminal error, if any
    steps: int = 0  # batches this item has been part of
    quota: Any = None  # admission's per-tenant record (released on the terminal transition)
    answered_at: float = -math.inf  # monotonic s of an early answer (Scheduler.resolve), while its batch ran

    @property
    def request_id(self) -> str:
        return self.item.request_id

    @property
    def deadline(self) -> float:
        return self.item.deadline

    @property
    def priority(self) -> Priority:
        return self.item.priority

    @property
    def done(self) -> bool:
        # Identity tests, not ``in TERMINAL``: hashing an Enum member runs Python code
        # (enum's __hash__), and this is asked of every caller several times per window.
        s = self.status
        return s is _ItemDone or s is _ItemFailed or s is _ItemDropped or s is _ItemCancelled


@dataclasses.dataclass(slots=True, eq=False)
class Batch:
    """A set of handles handed to the runner at once.

    ``cost`` is the sum of the handles' costs when the batch was formed; ``started_at``
    (monotonic s) is when ``schedule`` returned it, so service time = complete - started_at.
    """

    batch_id: int
    handles: tuple[Handle, ...]
    cost: float
    started_at: float

    def __len__(self) -> int:
        return len(self.handles)

    @property
    def payloads(self) -> list[Any]:
        """The items' payloads in batch order: ``[len(batch)]``."""
        return [h.item.payload for h in self.handles]


@dataclasses.dataclass(slots=True, frozen=True)
class Done:
    """The item finished with ``output``."""

    output: Any = None


@dataclasses.dataclass(slots=True, frozen=True)
class Continue:
    """The item needs another step. ``partial_output`` (unless None) is streamed to the
    caller; ``new_cost`` (unless None) replaces the item's cost, e.g. decode tokens grown;
    ``state`` (unless None) replaces ``handle.state``."""

    partial_output: Any = None
    new_cost: float | None = None
    state: Any = None


@dataclasses.dataclass(slots=True, frozen=True)
class Preempted:
    """The runner gave the item back: it returns to the queue with ``state`` (unless None
    replaces ``handle.state``) and keeps its deadline and priority."""

    state: Any = None


@dataclasses.dataclass(slots=True, frozen=True)
class Failed:
    """The item alone failed with ``error``; the rest of its batch goes on. A non-recserve
    exception is reported to the caller as INTERNAL, with the original as its cause."""

    error: BaseException


Outcome = Union[Done, Continue, Preempted, Failed]
Resolution = Union[Done, Failed]
"""What ``Scheduler.resolve`` accepts: a terminal outcome given before the batch ends."""
Outcomes = Sequence[Outcome]
