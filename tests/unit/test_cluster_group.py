"""ProcessGroup's start-up, readiness and stop logic on fake children, a fake health
watch and a fake clock (no processes, no sockets); RankerCluster's command line and
environment (built, never started). The real processes are exercised in
tests/integration/test_ranker_cluster.py and the shard lifecycle tests."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest

from recserve.cluster.group import HEALTH_STREAM_S, REPO_ROOT, Health, ProcessGroup
from recserve.cluster.rankers import RANKING_HEALTH_SERVICE, RankerCluster
from recserve.errors import ConfigError, Unavailable

BASE_PORT = 41_000


class FakeClock:
    """Monotonic time that only moves when the code under test sleeps; ``on_sleep``
    hooks play the world moving meanwhile (a child binding its port)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps = 0
        self.on_sleep: list[Callable[[], None]] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds
        for hook in list(self.on_sleep):
            hook()


class FakeChild:
    def __init__(self, pid: int, events: list[str]) -> None:
        self.pid = pid
        self.code: int | None = None  # set: the process has exited with it
        self.events = events

    def poll(self) -> int | None:
        return self.code

    def terminate(self) -> None:
        self.events.append(f"terminate {self.pid}")

    def kill(self) -> None:
        self.events.append(f"kill {self.pid}")
        self.code = -9

    def stop(self, grace_s: float = 5.0) -> int:
        self.events.append(f"stop {self.pid}")
        self.code = 0 if self.code is None else self.code
        return self.code


class FakeWorld:
    """A fake spawner (records argv, env, log file) whose children bind ``BASE_PORT + k``
    at the first sleep after they start, unless told to die or hang; and a health watch
    answering from a per-member script."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.clock = FakeClock()
        self.events: list[str] = []
        self.children: list[FakeChild] = []
        self.spawned: list[tuple[list[str], dict[str, str], Path]] = []
        self.health_calls: list[tuple[str, str, float]] = []
        self.health_script: dict[str, list[Health]] = {}  # address -> answers (then SERVING)
        self.silent: set[int] = set()  # members that never bind
        self.env = {"ENV_MARK": "1"}
        self.clock.on_sleep.append(self._bind)
        self._pending: list[tuple[int, Path, int]] = []  # (k, port_file, port) not yet bound

    def command(self, k: int, port: int, port_file: Path) -> list[str]:
        self._pending.append((k, port_file, port or BASE_PORT + k))
        return ["serve", str(k), "--port", str(port), "--port-file", str(port_file)]

    def spawn(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, log_file: str | Path | None = None, cwd: str | Path | None = None) -> FakeChild:
        assert env is not None and log_file is not None and cwd == REPO_ROOT
        child = FakeChild(1000 + len(self.children), self.events)
        self.children.append(child)
        self.spawned.append((list(argv), dict(env), Path(log_file)))
        self.events.append(f"spawn {argv[1]}")
        return child

    def _bind(self) -> None:
        for k, port_file, port in [p for p in self._pending if p[0] not in self.silent]:
            port_file.write_text(str(port))
        self._pending = [p for p in self._pending if p[0] in self.silent]

    def health(self, address: str, service: str, timeout_s: float) -> Health:
        self.health_calls.append((address, service, timeout_s))
        self.events.append(f"health {address}")
        script = self.health_script.get(address, [])
        return script.pop(0) if script else Health.SERVING

    def group(self, size: int = 2, **overrides: object) -> ProcessGroup:
        kwargs: dict[str, object] = dict(
            command=self.command, env=lambda: self.env, start_timeout_s=5.0, health_service="svc",
            spawn=self.spawn, health=self.health, clock=self.clock, sleep=self.clock.sleep,
        )  # fmt: skip
        kwargs.update(overrides)
        return ProcessGroup("ranker", self.root, size, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def world(tmp_path: Path) -> FakeWorld:
    return FakeWorld(tmp_path / "group")


def test_start_spawns_every_member_before_waiting_and_reports_their_ports(world: FakeWorld) -> None:
    group = world.group(3)
    group.start()
    # All spawned before the first wait: they load concurrently, not one after another.
    assert world.events[:3] == ["spawn 0", "spawn 1", "spawn 2"]
    assert group.addresses == [f"127.0.0.1:{BASE_PORT + k}" for k in range(3)]
    assert [group.pid(k) for k in range(3)] == [1000, 1001, 1002]
    for k, (argv, env, log_file) in enumerate(world.spawned):
        assert argv == ["serve", str(k), "--port", "0", "--port-file", str(world.root / f"ranker-{k}.port")]
        assert env == world.env and log_file == world.root / f"ranker-{k}.log" == group.log_path(k)
    # Each is waited on its own address and the group's health service.
    assert [(a, s) for a, s, _ in world.health_calls] == [(group.address(k), "svc") for k in range(3)]


def test_a_stale_port_file_is_not_taken_for_the_new_processes_port(world: FakeWorld) -> None:
    world.root.mkdir(parents=True)
    world.group(1).port_file(0).write_text("1")  # left by a killed earlier run
    group = world.group(1)
    group.start()
    assert group.address(0) == f"127.0.0.1:{BASE_PORT}"


def test_start_without_wait_knows_the_addresses_but_watches_no_health(world: FakeWorld) -> None:
    group = world.group(2)
    group.start(wait=False)
    assert group.addresses == [f"127.0.0.1:{BASE_PORT}", f"127.0.0.1:{BASE_PORT + 1}"]
    assert world.health_calls == []


def test_a_member_that_exits_before_binding_fails_start_with_its_log_tail_and_stops_the_rest(world: FakeWorld) -> None:
    group = world.group(2)
    world.silent.add(1)
    world.root.mkdir(parents=True)
    group.log_path(1).write_bytes(b"x" * 5000 + b"\nConfigError: ranker.models[] = ['bogus'] is invalid\n")

    def die() -> None:
        if len(world.children) == 2:
            world.children[1].code = 3

    world.clock.on_sleep.append(die)
    with pytest.raises(Unavailable) as err:
        group.start()
    message = str(err.value)
    assert "ranker 1 exited with code 3 before SERVING" in message and "ranker.models[] = ['bogus']" in message
    assert len(message) < 3200  # the tail, not the whole log
    # The healthy member is stopped too: a failed start leaves nothing running.
    assert {"terminate 1000", "stop 1000", "stop 1001"} <= set(world.events)
    assert 0 not in group and 1 not in group


def test_a_member_that_never_binds_times_out_on_the_injected_clock(world: FakeWorld) -> None:
    group = world.group(1, start_timeout_s=3.0)
    world.silent.add(0)
    with pytest.raises(Unavailable, match=r"ranker 0 did not bind a port within 3 s; see .*ranker-0.log"):
        group.start()
    assert world.clock.sleeps >= 3.0 / 0.02  # it polled until the (fake) deadline, no sooner
    assert "stop 1000" in world.events


def test_wait_serving_follows_health_until_serving_and_backs_off_only_when_unreachable(world: FakeWorld) -> None:
    group = world.group(1)
    group.start(wait=False)
    sleeps = world.clock.sleeps
    world.health_script[group.address(0)] = [Health.UNREACHABLE, Health.NOT_SERVING, Health.NOT_SERVING]
    group.wait_serving(0)
    assert len(world.health_calls) == 4
    assert world.clock.sleeps - sleeps == 1  # NOT_SERVING: the watch itself waited, re-watch at once
    assert all(0 < t <= HEALTH_STREAM_S for _, _, t in world.health_calls)


def test_wait_serving_raises_when_the_process_exits_or_the_deadline_passes(world: FakeWorld) -> None:
    group = world.group(2)
    group.start(wait=False)
    world.health_script[group.address(0)] = [Health.UNREACHABLE] * 10_000
    with pytest.raises(Unavailable, match=r"ranker 0 not SERVING within 1 s"):
        group.wait_serving(0, timeout_s=1.0)
    world.children[1].code = 1
    with pytest.raises(Unavailable, match="ranker 1 exited with code 1 before SERVING"):
        group.wait_serving(1)


def test_stop_signals_every_member_before_reaping_any(world: FakeWorld) -> None:
    group = world.group(3)
    group.start()
    world.events.clear()
    group.stop()
    # SIGTERM to all first so they drain in parallel; a reap-as-you-go stop would take N graces.
    assert world.events == ["terminate 1000", "terminate 1001", "terminate 1002", "stop 1000", "stop 1001", "stop 1002"]
    assert all(k not in group for k in range(3))


def test_kill_then_restart_reuses_the_port_and_reaps_the_dead_process(world: FakeWorld) -> None:
    group = world.group(2)
    group.start()
    address = group.address(1)
    group.kill(1)
    assert world.children[1].poll() == -9 and group.address(1) == address  # the port is kept
    world.events.clear()
    world.health_calls.clear()
    group.restart(1)
    # The dead process is reaped (lifeline closed) before the new one starts on the same port.
    assert world.events[:3] == ["terminate 1001", "stop 1001", "spawn 1"]
    argv = world.spawned[-1][0]
    assert argv[argv.index("--port") + 1] == str(BASE_PORT + 1)
    assert group.address(1) == address and group.pid(1) == 1002
    assert [a for a, _, _ in world.health_calls] == [address]  # restart waited for SERVING
    assert group.pid(0) == 1000  # the other member is untouched


def test_ranker_cluster_command_line_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRPC_EXPERIMENTS", "-event_engine_client")
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    cluster = RankerCluster(
        tmp_path / "cluster.toml", tmp_path / "models", ["127.0.0.1:5001", "unix:/tmp/s.sock"], num_rankers=2,
        data_root=tmp_path / "rankers", admin_token="tok", extra_args=["--extra"], env={"MALLOC_MMAP_THRESHOLD_": "4096"},
    )  # fmt: skip
    port_file = tmp_path / "rankers" / "ranker-1.port"
    argv = cluster._command(1, 0, port_file)
    assert argv[1:5] == ["-m", "recserve", "ranker", "serve"]
    flags = dict(zip(argv[5:-1:2], argv[6:-1:2], strict=True))
    assert flags == {
        "--config": str(tmp_path / "cluster.toml"), "--models": str(tmp_path / "models"), "--host": "127.0.0.1",
        "--port": "0", "--port-file": str(port_file), "--shards": "127.0.0.1:5001,unix:/tmp/s.sock",
    }  # fmt: skip
    assert argv[-1] == "--extra"
    env = cluster._env()
    assert env["RECSERVE_ADMIN_TOKEN"] == "tok"
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == env["OPENBLAS_NUM_THREADS"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO_ROOT)
    # Given transport settings own the transport variables: the parent's export is dropped.
    assert "GRPC_EXPERIMENTS" not in env and env["MALLOC_MMAP_THRESHOLD_"] == "4096"
    assert cluster.log_path(0) == tmp_path / "rankers" / "ranker-0.log"
    # No token, no env: nothing set, the inherited transport settings are left alone.
    plain = RankerCluster(tmp_path / "c.toml", tmp_path / "m", [], data_root=tmp_path / "r")
    assert "RECSERVE_ADMIN_TOKEN" not in plain._env() and plain._env()["GRPC_EXPERIMENTS"] == "-event_engine_client"
    assert "--shards" not in plain._command(0, 0, port_file)  # none given: the spec's shard_addresses


def test_ranker_cluster_names_the_servers_health_service_and_token_variable() -> None:
    # Duplicated as literals (the launcher must not import torch); they must not drift.
    from ranker.server import ADMIN_TOKEN_ENV, RANKING_SERVICE
    from recserve.cluster.group import ADMIN_TOKEN_ENV as LAUNCHER_TOKEN_ENV
    from recserve.cli.shard_cmd import ADMIN_TOKEN_ENV as SHARD_TOKEN_ENV

    assert RANKING_HEALTH_SERVICE == RANKING_SERVICE
    assert LAUNCHER_TOKEN_ENV == ADMIN_TOKEN_ENV == SHARD_TOKEN_ENV


def test_ranker_cluster_refuses_a_bad_count_or_address(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="num_rankers = 0"):
        RankerCluster(tmp_path / "c.toml", tmp_path / "m", ["127.0.0.1:1"], num_rankers=0, data_root=tmp_path)
    with pytest.raises(ConfigError, match=r"shard_addresses = \['a:1,b:2'\]"):
        RankerCluster(tmp_path / "c.toml", tmp_path / "m", ["a:1,b:2"], data_root=tmp_path)
