"""The Policy interface, the view of the scheduler a policy works through, and the one
factory keyed by :class:`PolicyKind`.

A policy decides *when* to form a batch and *what* goes in it, from time, cost,
deadlines and priorities; it knows nothing of shards or models. The core owns all state
(queue, resident set, in-flight batches, admission) and the policy acts only through a
:class:`SchedulerView`, so every transition keeps the core's accounting consistent.

The interface is shaped for iteration-level (decode) scheduling as well as one-shot
batches: in ``select`` a policy sees the running and resident items, may run resident
items again (Continue), admit new ones from the queue at every step, preempt resident
items back to the queue and change an item's cost. Lifecycle hooks (``on_add``,
``on_continue``, ``on_requeue``, ``on_finish``, ``on_batch_done``) let a policy keep its
own resources (e.g. KV blocks) in step with the core. A new policy is added by
subclassing :class:`Policy` and calling :func:`register_policy` — no core file changes.
"""

from __future__ import annotations

import abc
import enum
import importlib
from typing import Any, Callable, ClassVar, Iterable, Protocol, Sequence

from recserve.errors import ConfigError
from recserve.scheduling.types import Batch, Handle


class PolicyKind(enum.Enum):
    DYNAMIC = "dynamic"  # ranker stages: max batch + adaptive window, SLO-adaptive
    FEATURE_PARALLEL = "feature_parallel"  # lookup client: everything within a window
    CONTINUOUS = "continuous"  # LLM decode: iteration-level; registered by the decode package


class SchedulerView(Protocol):
    """What a policy may read and do. Batch-building calls (``take``, ``run``,
    ``preempt``, ``set_cost``) are valid only inside ``Policy.select``."""

    @property
    def queued_count(self) -> int: ...

    @property
    def queued_cost(self) -> float: ...

    @property
    def open_since(self) -> float | None:
        """When the current batch-formation window opened (monotonic s); None if the queue is empty."""
        ...

    @property
    def resident(self) -> Sequence[Handle]:
        """Items that returned Continue and wait for their next step (a snapshot, in the
        order they became resident)."""
        ...

    @property
    def resident_count(self) -> int: ...

    @property
    def running(self) -> Iterable[Handle]:
        """Items inside batches the runner has not completed yet."""
        ...

    @property
    def inflight_batches(self) -> int: ...

    @property
    def flush(self) -> bool:
        """True while the owner drains: form batches now, do not wait for windows."""
        ...

    @property
    def batch_size(self) -> int:
        """Items in the batch being built by the current ``select``."""
        ...

    @property
    def batch_cost(self) -> float: ...

    def earliest_deadline(self) -> float:
        """Minimum deadline over queued items (math.inf if none)."""
        ...

    def estimate_service_s(self, cost: float) -> float:
        """Expected service time of a batch of ``cost`` (from measured batches)."""
        ...

    def peek(self) -> Handle | None:
        """The next queued item in priority / EDF order, without taking it."""
        ...

    def take(self) -> Handle:
        """Move the next queued item into the batch being built."""
        ...

    def take_while(self, max_cost: float) -> int:
        """Take queued items in order while the batch cost stays <= ``max_cost`` (the first
        item of an empty batch always); returns how many. Same as peek/take in a loop."""
        ...

    def run(self, handle: Handle) -> None:
        """Put a resident item into the batch being built (its next step)."""
        ...

    def preempt(self, handle: Handle, state: Any = None) -> None:
        """Send a resident item back to the queue (``state``, unless None, replaces its state)."""
        ...

    def set_cost(self, handle: Handle, cost: float) -> None:
        """Change a queued or resident item's cost (queue and tenant accounting follow)."""
        ...


class Policy(abc.ABC):
    """Decides when and what to batch. Subclasses implement ``ready_at`` and ``select``
    consistently: ``select(view, now)`` builds a non-empty batch exactly when
    ``ready_at(view, now) <= now``; otherwise the serving loop would spin or stall."""

    kind: ClassVar[PolicyKind]

    @abc.abstractmethod
    def ready_at(self, view: SchedulerView, now: float) -> float | None:
        """The earliest time at which ``select`` would form a batch given the current
        state, or None if only a new event (arrival, completion) can make one. Called
        only when there is queued or resident work. A time <= now means "now"."""

    @abc.abstractmethod
    def select(self, view: SchedulerView, now: float) -> None:
        """Build the next batch through ``view`` (take / run / preempt / set_cost), or
        leave it empty to wait."""

    def on_add(self, handle: Handle, now: float) -> None:
        """An item passed admission and is about to be queued (e.g. measure the arrival
        rate). Raising a RecserveError here refuses it — e.g. InvalidArgument for a prompt
        larger than the whole KV cache: the core undoes the admission (tenant cost and rate
        token back), counts it as rejected and ``add`` raises the error to the caller."""

    def on_continue(self, handle: Handle, now: float) -> None:
        """An item returned Continue and is now resident (its cost may have changed)."""

    def on_requeue(self, handle: Handle, now: float) -> None:
        """The runner preempted an item; it is queued again."""

    def on_finish(self, handle: Handle, now: float) -> None:
        """An item reached a terminal status (``handle.status``: done, failed, dropped,
        cancelled); release anything the policy holds for it. For an item cancelled while
        running this comes when its batch completes, since the runner still used it."""

    def on_batch_done(self, batch: Batch, service_s: float, now: float) -> None:
        """A batch completed after ``service_s`` (not called for failed batches)."""

    def gauges(self) -> dict[str, float]:
        """The policy's own gauges for ``Scheduler.stats()`` (e.g. current window)."""
        return {}


PolicyFactory = Callable[[Any], Policy]
_REGISTRY: dict[PolicyKind, PolicyFactory] = {}
_BUILTIN_MODULES = ("recserve.scheduling.dynamic", "recserve.scheduling.feature_parallel")


def register_policy(kind: PolicyKind, factory: PolicyFactory, *, replace: bool = False) -> None:
    """Register the factory that builds ``kind`` from its config object."""
    if kind in _REGISTRY and not replace and _REGISTRY[kind] is not factory:
        raise ConfigError(f"a policy is already registered for {kind}; pass replace=True to override it")
    _REGISTRY[kind] = factory


def make_policy(kind: PolicyKind, config: Any) -> Policy:
    """Build the policy registered for ``kind`` from ``config`` (e.g.
    ``make_policy(PolicyKind.DYNAMIC, DynamicBatchConfig(max_batch_cost=256, max_wait_ms=2))``)."""
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)  # registers the built-in policies
    factory = _REGISTRY.get(kind)
    if factory is None:
        raise ConfigError(
            f"no scheduling policy is registered for {kind}; the module defining it must call "
            f"register_policy({kind}, factory) before make_policy"
        )
    return factory(config)
