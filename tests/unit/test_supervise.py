"""The supervisor's state machine (recserve/cluster/supervise.py): restarts with a backoff
that doubles per consecutive crash and resets after a healthy run, crash-loop detection
over a window, a failed restart counted as a crash, the JSON report. Fake groups, fake
clock; no processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recserve.cluster.supervise import Supervisor, SupervisorConfig, SupervisorThread, read_report
from recserve.errors import ConfigError

CFG = SupervisorConfig(initial_backoff_s=1.0, multiplier=2.0, max_backoff_s=4.0, healthy_after_s=10.0, crash_loop_exits=3, crash_loop_window_s=30.0)


class FakeGroup:
    """Members 0..size-1; ``crash(k, code)`` makes k exit; ``restart`` records and revives."""

    def __init__(self, kind: str, size: int) -> None:
        self.kind = kind
        self.size = size
        self.codes: dict[int, int | None] = {k: None for k in range(size)}
        self.restarts: list[int] = []
        self.fail_restart = False

    def crash(self, k: int, code: int = -9) -> None:
        self.codes[k] = code

    def exit_code(self, k: int) -> int | None:
        return self.codes[k]

    def restart(self, k: int, *, wait: bool = True) -> None:
        assert wait is False  # the supervisor never blocks on a child's start-up
        if self.fail_restart:
            raise OSError("spawn failed")
        self.restarts.append(k)
        self.codes[k] = None


def test_a_crashed_child_is_restarted_after_its_backoff_and_not_before() -> None:
    shards, rankers = FakeGroup("shard", 3), FakeGroup("ranker", 2)
    sup = Supervisor([shards, rankers], CFG)
    assert sup.tick(0.0) == []
    shards.crash(1)
    events = sup.tick(1.0)
    assert events == ["shard-1 exited with code -9; restarting in 1.0 s (crash 1 in a row)"]
    assert sup.report(1.5)["children"]["shard-1"] == {
        "state": "backoff", "restarts": 0, "last_exit_code": -9, "recent_exits": 1, "crash_looping": False, "restart_in_s": 0.5,
    }  # fmt: skip
    sup.tick(1.9)
    assert shards.restarts == []  # backoff not over
    assert sup.tick(2.0) == ["shard-1 restarted (restart 1)"]
    assert shards.restarts == [1] and rankers.restarts == []
    assert sup.report(2.0)["children"]["shard-1"]["state"] == "running"


def test_backoff_doubles_per_consecutive_crash_caps_and_resets_after_a_healthy_run() -> None:
    group = FakeGroup("ranker", 1)
    sup = Supervisor([group], CFG)
    t = 0.0
    waits = []
    for _ in range(4):  # crash right after every restart
        group.crash(0)
        sup.tick(t)
        restart_at = t + sup.report(t)["children"]["ranker-0"]["restart_in_s"]
        waits.append(restart_at - t)
        t = restart_at
        sup.tick(t)
    assert waits == [1.0, 2.0, 4.0, 4.0]  # 1, 2, 4, then capped at max_backoff_s
    sup.tick(t + 10.0)  # up for healthy_after_s: the count starts over
    group.crash(0)
    sup.tick(t + 11.0)
    assert sup.report(t + 11.0)["children"]["ranker-0"]["restart_in_s"] == 1.0


def test_a_crash_looping_child_is_reported_and_still_restarted_until_the_window_forgets() -> None:
    group = FakeGroup("shard", 2)
    sup = Supervisor([group], CFG)
    t = 0.0
    for _ in range(3):
        group.crash(0, code=1)
        sup.tick(t)
        t += 5.0  # past every backoff here (<= 4 s)
        events = sup.tick(t)
    assert events == ["shard-0 restarted (restart 3, crash-looping)"]
    report = sup.report(t)
    assert report["crash_looping"] == ["shard-0"] and sup.crash_looping == ["shard-0"]
    assert report["children"]["shard-0"]["recent_exits"] == 3 and report["children"]["shard-1"]["crash_looping"] is False
    assert group.restarts == [0, 0, 0]
    sup.tick(t + CFG.crash_loop_window_s)  # no exit for a whole window: no longer looping
    assert sup.crash_looping == []


def test_a_failed_restart_counts_as_another_crash() -> None:
    group = FakeGroup("cascade", 1)
    sup = Supervisor([group], CFG)
    group.crash(0, code=2)
    sup.tick(0.0)
    group.fail_restart = True
    events = sup.tick(1.0)
    assert events == ["cascade-0 exited with code 2; restarting in 2.0 s (crash 2 in a row)"]
    child = sup.report(1.0)["children"]["cascade-0"]
    assert child["state"] == "backoff" and "spawn failed" in child["last_error"]
    group.fail_restart = False
    sup.tick(3.0)
    assert group.restarts == [0]


def test_the_thread_writes_the_report_file_the_gateway_reads(tmp_path: Path) -> None:
    group = FakeGroup("shard", 1)
    group.crash(0)
    state = tmp_path / "supervisor.json"
    assert read_report(state) is None and read_report(None) is None  # no file yet / no path: no report
    thread = SupervisorThread(Supervisor([group], CFG), state_file=state, clock=lambda: 0.0)
    thread.start()  # writes the first report at once
    thread.stop()
    report = read_report(state)
    assert report is not None and set(report["children"]) == {"shard-0"} and report["crash_looping"] == []
    assert json.loads(state.read_text()) == report
    state.write_text("{not json")
    assert read_report(state) is None  # a torn or foreign file is no report, not an error


@pytest.mark.parametrize(("field", "overrides"), [
    ("supervisor.max_backoff_s", {"initial_backoff_s": 5.0, "max_backoff_s": 1.0}),
    ("supervisor.multiplier", {"multiplier": 0.5}),
    ("supervisor.crash_loop_exits", {"crash_loop_exits": 0}),
])  # fmt: skip
def test_config_errors_name_the_field(field: str, overrides: dict[str, float]) -> None:
    with pytest.raises(ConfigError) as caught:
        SupervisorConfig(**overrides)  # type: ignore[arg-type]
    assert str(caught.value).startswith(f"{field} = ")
