"""Supervision: restart a crashed child with backoff, and say so when it crash-loops.

``recserve serve`` (:class:`~recserve.cluster.stack.ServingStack`) runs one
:class:`Supervisor` over every child once the stack is up (reference §10.11.9): a child
that exits on its own (a crash, an OOM kill, a SIGKILL) is restarted on its old port,
with its old data directory (a shard reopens its RocksDB, so every acknowledged upsert
is served again), after a backoff that doubles per crash and resets once a child has
stayed up ``healthy_after_s``. A child with ``crash_loop_exits`` exits within
``crash_loop_window_s`` is *crash-looping*: it is still restarted (at the capped
backoff), and it is reported, not hidden: the report (:meth:`Supervisor.report`) is
written as JSON to a state file that the gateway reads for ``/readyz`` (503 while any
child crash-loops) and its status page.

Two layers, the core free of I/O (docs/architecture.md §2):

- :class:`Supervisor` is a synchronous state machine over :class:`Supervised` groups
  (a :class:`~recserve.cluster.group.ProcessGroup` is one): ``tick(now)`` polls every
  member, schedules restarts and performs the due ones; tests drive it with fakes and a
  fake clock;
- :class:`SupervisorThread` ticks it every ``poll_s`` on a daemon thread and writes the
  report file when it changes. ``stop()`` joins the thread before the stack stops its
  children, so a child being stopped is never restarted::

    sup = SupervisorThread(Supervisor([stack_groups...], SupervisorConfig()), state_file=run / "supervisor.json")
    sup.start()
    ...
    sup.stop()
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from recserve.errors import require

log = logging.getLogger(__name__)

# The gateway reads the supervisor's report from the file this variable names (set by
# ServingStack on the gateway's environment); unset or missing file: no report.
SUPERVISOR_STATE_ENV = "RECSERVE_SUPERVISOR_STATE"


@dataclasses.dataclass(frozen=True)
class SupervisorConfig:
    """Restart policy. A child's n-th consecutive crash waits
    ``min(max_backoff_s, initial_backoff_s * multiplier ** (n - 1))`` before its restart;
    ``healthy_after_s`` of uptime resets n. ``crash_loop_exits`` exits within
    ``crash_loop_window_s`` mark it crash-looping (reported until the window forgets them)."""

    initial_backoff_s: float = 0.5
    multiplier: float = 2.0
    max_backoff_s: float = 30.0
    healthy_after_s: float = 30.0
    crash_loop_exits: int = 3
    crash_loop_window_s: float = 120.0
    poll_s: float = 0.2

    def __post_init__(self) -> None:
        require(self.initial_backoff_s >= 0, "supervisor.initial_backoff_s", self.initial_backoff_s, "use a backoff >= 0 seconds")
        require(self.multiplier >= 1, "supervisor.multiplier", self.multiplier, "use a multiplier >= 1 (1 = constant backoff)")
        require(self.max_backoff_s >= self.initial_backoff_s, "supervisor.max_backoff_s", self.max_backoff_s,
                f"use at least initial_backoff_s ({self.initial_backoff_s})")  # fmt: skip
        require(self.healthy_after_s > 0, "supervisor.healthy_after_s", self.healthy_after_s, "use a positive uptime in seconds")
        require(self.crash_loop_exits >= 1, "supervisor.crash_loop_exits", self.crash_loop_exits, "use at least 1 exit")
        require(self.crash_loop_window_s > 0, "supervisor.crash_loop_window_s", self.crash_loop_window_s, "use a positive window in seconds")
        require(self.poll_s > 0, "supervisor.poll_s", self.poll_s, "use a positive poll interval in seconds")

    def backoff_s(self, crashes: int) -> float:
        """The wait before restarting a child after its ``crashes``-th consecutive crash (>= 1)."""
        return min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** max(0, crashes - 1))


class Supervised(Protocol):
    """A group of children (``ProcessGroup``): ``kind``, ``size``, and per member ``k``
    its exit code (None while it runs) and a restart that does not wait for SERVING."""

    kind: str
    size: int

    def exit_code(self, k: int) -> int | None: ...

    def restart(self, k: int, *, wait: bool = True) -> None: ...


class ChildState(enum.Enum):
    RUNNING = "running"
    BACKOFF = "backoff"  # exited; restart scheduled at ``restart_at``


@dataclasses.dataclass
class _Child:
    group: Supervised
    k: int
    started_at: float
    state: ChildState = ChildState.RUNNING
    crashes: int = 0  # consecutive: reset once it stays up healthy_after_s
    restarts: int = 0  # all time
    last_exit_code: int | None = None
    restart_at: float = 0.0
    exits: collections.deque[float] = dataclasses.field(default_factory=collections.deque)  # exit times in the window
    last_error: str = ""

    @property
    def name(self) -> str:
        return f"{self.group.kind}-{self.k}"


class Supervisor:
    """Watches every member of ``groups``; see the module docstring. Not thread-safe:
    one caller ticks it (the :class:`SupervisorThread`)."""

    def __init__(self, groups: Sequence[Supervised], config: SupervisorConfig = SupervisorConfig(), *, now: float = 0.0) -> None:
        self.config = config
        self._children = [_Child(group=g, k=k, started_at=now) for g in groups for k in range(g.size)]

    def tick(self, now: float) -> list[str]:
        """Poll every child, restart those whose backoff is over; returns what happened
        (one line per exit noticed or restart made, for the log)."""
        cfg = self.config
        events: list[str] = []
        for child in self._children:
            while child.exits and child.exits[0] <= now - cfg.crash_loop_window_s:
                child.exits.popleft()
            if child.state is ChildState.RUNNING:
                code = child.group.exit_code(child.k)
                if code is None:
                    if child.crashes and now - child.started_at >= cfg.healthy_after_s:
                        child.crashes = 0  # stayed up: the next crash starts the backoff over
                    continue
                self._exited(child, code, now, events)
            if child.state is ChildState.BACKOFF and now >= child.restart_at:
                try:
                    child.group.restart(child.k, wait=False)  # same port, same data; readiness is the child's health
                except Exception as exc:  # a failed spawn is one more crash: back off again
                    child.last_error = f"restart failed: {exc!r}"
                    log.exception("supervisor: restarting %s failed", child.name)
                    self._exited(child, child.last_exit_code if child.last_exit_code is not None else -1, now, events)
                    continue
                child.state = ChildState.RUNNING
                child.started_at = now
                child.restarts += 1
                events.append(f"{child.name} restarted (restart {child.restarts}{', crash-looping' if self._looping(child) else ''})")
        return events

    def _exited(self, child: _Child, code: int, now: float, events: list[str]) -> None:
        cfg = self.config
        child.crashes += 1
        child.last_exit_code = code
        child.exits.append(now)
        backoff = cfg.backoff_s(child.crashes)
        child.state = ChildState.BACKOFF
        child.restart_at = now + backoff
        events.append(f"{child.name} exited with code {code}; restarting in {backoff:.1f} s (crash {child.crashes} in a row)")

    def _looping(self, child: _Child) -> bool:
        return len(child.exits) >= self.config.crash_loop_exits

    @property
    def crash_looping(self) -> list[str]:
        """Names (``"shard-1"``) of the children crash-looping now."""
        return [c.name for c in self._children if self._looping(c)]

    def report(self, now: float) -> dict[str, Any]:
        """The JSON report: ``crash_looping`` (names) and per child its state, restarts,
        last exit code, exits in the window and, in backoff, seconds until its restart."""
        children = {}
        for c in self._children:
            entry: dict[str, Any] = {
                "state": c.state.value, "restarts": c.restarts, "last_exit_code": c.last_exit_code,
                "recent_exits": len(c.exits), "crash_looping": self._looping(c),
            }  # fmt: skip
            if c.state is ChildState.BACKOFF:
                entry["restart_in_s"] = round(max(0.0, c.restart_at - now), 3)
            if c.last_error:
                entry["last_error"] = c.last_error
            children[c.name] = entry
        return {"crash_looping": self.crash_looping, "window_s": self.config.crash_loop_window_s, "children": children}


class SupervisorThread:
    """Ticks ``supervisor`` every ``poll_s`` on a daemon thread; writes its report to
    ``state_file`` (atomically: tmp + rename) whenever it changes, and ``on_event`` gets
    each event line (``recserve serve`` prints them)."""

    def __init__(
        self,
        supervisor: Supervisor,
        *,
        state_file: str | Path | None = None,
        on_event: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.supervisor = supervisor
        self.state_file = None if state_file is None else Path(state_file)
        self._on_event = on_event
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._written: str | None = None

    def start(self) -> None:
        self._write(self._clock())
        self._thread = threading.Thread(target=self._run, name="recserve-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop ticking; returns once no restart is in progress (the stack may then stop its children)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.supervisor.config.poll_s):
            now = self._clock()
            try:
                events = self.supervisor.tick(now)
            except Exception:  # a bug here must not end supervision silently: log, keep going
                log.exception("supervisor tick failed")
                continue
            for line in events:
                log.warning("supervisor: %s", line)
                if self._on_event is not None:
                    self._on_event(line)
            self._write(now)

    def _write(self, now: float) -> None:
        if self.state_file is None:
            return
        report = self.supervisor.report(now)
        stable = json.dumps({**report, "children": {n: {k: v for k, v in c.items() if k != "restart_in_s"} for n, c in report["children"].items()}}, sort_keys=True)
        if stable == self._written and not self.supervisor.crash_looping:
            return  # unchanged (the countdown alone is not worth a write)
        tmp = self.state_file.with_name(self.state_file.name + ".tmp")
        tmp.write_text(json.dumps(report, sort_keys=True))
        os.replace(tmp, self.state_file)
        self._written = stable


def read_report(path: str | Path | None) -> dict[str, Any] | None:
    """The supervisor's last report from ``path`` (the gateway's side); None when there is
    no path, no file yet, or it cannot be read (no report is not an error)."""
    if not path:
        return None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
