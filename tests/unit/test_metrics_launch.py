"""Metrics ports through the launchers, on fake children and a fake clock (no processes):
ProcessGroup passes ``--metrics-port`` / ``--metrics-port-file``, reads the bound port
and builds ``metrics_url``; a restart keeps the port; -1 means no flags read back and
no URL; the serve commands take the flags (the CLI wins over the spec)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from recserve.cli.main import build_parser
from recserve.cluster.cascade import CascadeCluster
from recserve.cluster.rankers import RankerCluster
from recserve.errors import ConfigError
from tests.unit.test_cluster_group import BASE_PORT, FakeChild, FakeWorld

METRICS_BASE = 43_000


class MetricsWorld(FakeWorld):
    """FakeWorld whose children also bind a metrics port (METRICS_BASE + k when asked
    for 0) and write it to their ``--metrics-port-file`` at the first sleep."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self._metrics_pending: list[tuple[Path, int]] = []
        self.clock.on_sleep.insert(0, self._bind_metrics)

    def spawn(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, log_file: str | Path | None = None, cwd: str | Path | None = None) -> FakeChild:
        if "--metrics-port-file" in argv:
            port = int(argv[argv.index("--metrics-port") + 1])
            k = int(argv[1])
            if port != -1:
                self._metrics_pending.append((Path(argv[argv.index("--metrics-port-file") + 1]), port or METRICS_BASE + k))
        return super().spawn(argv, env=env, log_file=log_file, cwd=cwd)

    def _bind_metrics(self) -> None:
        for path, port in self._metrics_pending:
            path.write_text(str(port))
        self._metrics_pending.clear()


@pytest.fixture
def world(tmp_path: Path) -> MetricsWorld:
    return MetricsWorld(tmp_path / "group")


def flags(argv: list[str]) -> dict[str, str]:
    return {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i] in ("--metrics-port", "--metrics-port-file")}


def test_free_metrics_ports_are_read_back_and_become_urls(world: MetricsWorld) -> None:
    group = world.group(2, metrics_port=0)
    group.start()
    for k, (argv, _, _) in enumerate(world.spawned):
        assert flags(argv) == {"--metrics-port": "0", "--metrics-port-file": str(world.root / f"ranker-{k}.metrics-port")}
        assert argv[: argv.index("--metrics-port")] == ["serve", str(k), "--port", "0", "--port-file", str(group.port_file(k))]
    assert [group.metrics_url(k) for k in range(2)] == [f"http://127.0.0.1:{METRICS_BASE + k}/metrics" for k in range(2)]
    assert group.addresses == [f"127.0.0.1:{BASE_PORT + k}" for k in range(2)]  # the gRPC ports are unaffected


def test_a_fixed_base_gives_member_k_base_plus_k_and_a_restart_keeps_it(world: MetricsWorld) -> None:
    group = world.group(3, metrics_port=9100)
    group.start()
    assert [flags(argv)["--metrics-port"] for argv, _, _ in world.spawned] == ["9100", "9101", "9102"]
    assert group.metrics_url(2) == "http://127.0.0.1:9102/metrics"
    group.kill(1)
    group.restart(1)
    assert flags(world.spawned[-1][0])["--metrics-port"] == "9101" and group.metrics_url(1) == "http://127.0.0.1:9101/metrics"


def test_a_restart_of_a_free_port_member_asks_for_the_port_it_had(world: MetricsWorld) -> None:
    group = world.group(1, metrics_port=0)
    group.start()
    group.restart(0)
    assert flags(world.spawned[-1][0])["--metrics-port"] == str(METRICS_BASE)  # not 0: the URL stays valid


def test_minus_one_means_no_metrics_server_and_no_url(world: MetricsWorld) -> None:
    group = world.group(2, metrics_port=-1)
    group.start()  # no metrics port file is waited for: none will be written
    assert [flags(argv)["--metrics-port"] for argv, _, _ in world.spawned] == ["-1", "-1"]
    assert group.metrics_url(0) is None and group.metrics_url(1) is None


def test_without_a_metrics_port_the_group_passes_no_flags(world: MetricsWorld) -> None:
    group = world.group(1)
    group.start()
    assert flags(world.spawned[0][0]) == {} and group.metrics_url(0) is None


def test_bad_metrics_ports_are_config_errors(world: MetricsWorld) -> None:
    with pytest.raises(ConfigError, match="metrics_port = -5"):
        world.group(1, metrics_port=-5)
    with pytest.raises(ConfigError, match="metrics_port = 65535 is invalid for 2 rankers"):
        world.group(2, metrics_port=65535)


def test_launchers_hand_their_metrics_port_to_the_group(tmp_path: Path) -> None:
    rankers = RankerCluster(tmp_path / "c.toml", tmp_path / "m", ["127.0.0.1:1"], num_rankers=2, data_root=tmp_path / "r", metrics_port=9200)
    assert rankers._group.metrics_port == 9200
    cascade = CascadeCluster(tmp_path / "c.toml", tmp_path / "m", ["127.0.0.1:1"], ["127.0.0.1:2"], data_root=tmp_path / "c", metrics_port=-1)
    assert cascade._group.metrics_port == -1


@pytest.mark.parametrize("command", [["shard", "serve", "--plan", "p", "--shard-id", "0", "--data", "d"], ["ranker", "serve"], ["cascade", "serve", "--rankers", "a:1"]])
def test_every_serve_command_takes_the_metrics_flags(command: list[str]) -> None:
    args = build_parser().parse_args([*command, "--metrics-port", "9300", "--metrics-port-file", "/tmp/m.port"])
    assert args.metrics_port == 9300 and args.metrics_port_file == "/tmp/m.port"
    assert build_parser().parse_args(command).metrics_port is None  # not given: the spec's value


@pytest.mark.parametrize("section", ["ranker", "cascade"])
def test_the_cli_metrics_port_wins_over_the_spec(section: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    from recserve.config.load import DEFAULT_SPEC

    spec = tmp_path / "spec.toml"
    spec.write_text(DEFAULT_SPEC.replace(f"\n[{section}]\n", f"\n[{section}]\nmetrics_port = 9400\n", 1))
    server = importlib.import_module(f"{section}.server")
    seen: list[object] = []

    async def fake_serve(config: object, stop: object = None) -> None:
        seen.append(config)

    monkeypatch.setattr(server, "serve", fake_serve)
    base = [section, "serve", "--config", str(spec), "--models", str(tmp_path), "--shards", "127.0.0.1:1"] + (["--rankers", "127.0.0.1:2"] if section == "cascade" else [])
    for extra, want in (([], 9400), (["--metrics-port", "-1", "--metrics-port-file", "m.port"], -1)):
        args = build_parser().parse_args(base + extra)
        assert args.func(args) == 0
        config = seen.pop()
        assert getattr(config, "metrics_port") == want
        assert getattr(config, "metrics_port_file") == ("m.port" if extra else "")


def test_the_stack_names_every_childs_metrics_url_and_leaves_out_those_without(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace
    from typing import Any, cast

    from recserve.cluster.stack import ServingStack
    from recserve.config import load

    stack = ServingStack(load(None), spec_path=tmp_path / "s.toml", models_dir=tmp_path / "m", plan_path=tmp_path / "p.json", data_root=tmp_path / "run")
    monkeypatch.setattr(stack.shards, "metrics_url", lambda k: f"http://127.0.0.1:{9100 + k}/metrics")
    assert stack.metrics_urls() == {"shard-0": "http://127.0.0.1:9100/metrics", "shard-1": "http://127.0.0.1:9101/metrics"}  # not started further
    stack.rankers = cast(Any, SimpleNamespace(num_rankers=2, metrics_url=lambda k: None if k == 1 else "http://127.0.0.1:9200/metrics"))
    stack.cascade = cast(Any, SimpleNamespace(metrics_url="http://127.0.0.1:9300/metrics"))
    assert stack.metrics_urls() == {
        "shard-0": "http://127.0.0.1:9100/metrics", "shard-1": "http://127.0.0.1:9101/metrics",
        "ranker-0": "http://127.0.0.1:9200/metrics", "cascade-0": "http://127.0.0.1:9300/metrics",
    }  # fmt: skip
