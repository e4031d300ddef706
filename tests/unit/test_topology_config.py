"""``[topology]``: parsed, validated with the field named, and wired into the launchers
that ``recserve serve`` composes (built, never started: no processes, no sockets)."""

from __future__ import annotations

from pathlib import Path

import pytest

from recserve.cluster.cascade import RECOMMENDER_HEALTH_SERVICE, CascadeCluster
from recserve.cluster.rankers import RankerCluster
from recserve.cluster.shards import ShardCluster
from recserve.cluster.stack import ServingStack
from recserve.config import default_config, loads
from recserve.config.spec import TableConfig, TopologyConfig
from recserve.errors import ConfigError
from tests.unit.test_cluster_group import FakeWorld

BASE = """
[[tables]]
name = "item"
rows = 1000
dim = 16

[[features]]
name = "history"
table = "item"

[sharding]
num_shards = 3
hot_replicas = 2
"""


def test_embedded_default_starts_two_rankers_on_free_loopback_ports() -> None:
    topo = default_config().topology
    assert topo == TopologyConfig()
    assert (topo.rankers, topo.host, topo.cascade_port, topo.unix_sockets) == (2, "127.0.0.1", 0, False)
    assert topo.ports("shard_ports", 2) == (0, 0) and topo.ports("ranker_ports", 2) == (0, 0)


def test_a_section_sets_counts_ranges_and_unix_sockets() -> None:
    cfg = loads(BASE + '[topology]\nrankers = 3\nhost = "127.0.0.2"\nshard_ports = "7100-7102"\nranker_ports = "7200-7299"\ncascade_port = 7300\nunix_sockets = true\n')
    topo = cfg.topology
    assert (topo.rankers, topo.host, topo.cascade_port, topo.unix_sockets) == (3, "127.0.0.2", 7300, True)
    assert topo.ports("shard_ports", cfg.sharding.num_shards) == (7100, 7101, 7102)  # exactly fills its range
    assert topo.ports("ranker_ports", topo.rankers) == (7200, 7201, 7202)  # the first of a wider range


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        ("rankers = 0", "topology.rankers", "0"),
        ('rankers = "2"', "topology.rankers", "'2'"),
        ('host = "localhost"', "topology.host", "'localhost'"),
        ('host = "127.0.0.256"', "topology.host", "'127.0.0.256'"),
        ('shard_ports = "7100"', "topology.shard_ports", "'7100'"),
        ('shard_ports = "7199-7100"', "topology.shard_ports", "'7199-7100'"),
        ('ranker_ports = "0-10"', "topology.ranker_ports", "'0-10'"),
        ('ranker_ports = "7200-70000"', "topology.ranker_ports", "'7200-70000'"),
        ("shard_ports = 7100", "topology.shard_ports", "7100"),
        ('ranker_ports = "7200-7200"', "topology.ranker_ports", "'7200-7200'"),  # 1 port, 2 rankers
        ('shard_ports = "7100-7101"', "topology.shard_ports", "'7100-7101'"),  # 2 ports, 3 shards
        ('shard_ports = "7100-7199"\nranker_ports = "7150-7159"', "topology.ranker_ports", "'7150-7159'"),  # overlap
        ('ranker_ports = "7200-7209"\ncascade_port = 7205', "topology.cascade_port", "7205"),
        ("cascade_port = 70000", "topology.cascade_port", "70000"),
        ('unix_sockets = "yes"', "topology.unix_sockets", "'yes'"),
        ("replicas = 2", "topology.replicas", "2"),
    ],
)
def test_bad_values_name_the_field_and_the_value(section: str, field: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        loads(BASE + "[topology]\n" + section + "\n")
    assert info.value.message.startswith(f"{field} = {value} "), info.value.message


def test_each_launcher_binds_the_topology_host_and_ports(tmp_path: Path) -> None:
    cfg = loads(BASE + '[topology]\nrankers = 2\nhost = "127.0.0.2"\nshard_ports = "7100-7199"\nranker_ports = "7200-7209"\ncascade_port = 7300\nunix_sockets = true\n')
    stack = ServingStack(cfg, spec_path=tmp_path / "spec.toml", models_dir=tmp_path / "models", plan_path=tmp_path / "plan.json", data_root=tmp_path / "run")
    shards = stack.shards
    assert shards._group.first_ports == (7100, 7101, 7102) and shards.unix_sockets
    argv = shards._command(1, 7101, tmp_path / "shard-1.port")
    assert argv[argv.index("--host") + 1] == "127.0.0.2" and argv[argv.index("--port") + 1] == "7101"
    assert "--unix-socket" in argv and argv[argv.index("--load-from") + 1] == str(tmp_path / "models")

    rankers = RankerCluster(tmp_path / "spec.toml", tmp_path / "models", ["unix:/a.sock"], num_rankers=2, data_root=tmp_path, host="127.0.0.2", ports=(7200, 7201))
    argv = rankers._command(0, 7200, tmp_path / "ranker-0.port")
    assert argv[argv.index("--host") + 1] == "127.0.0.2" and argv[argv.index("--shards") + 1] == "unix:/a.sock"

    cascade = CascadeCluster(tmp_path / "spec.toml", tmp_path / "models", ["127.0.0.2:7200", "127.0.0.2:7201"], ["unix:/a.sock"], data_root=tmp_path, host="127.0.0.2", port=7300)
    assert cascade._group.first_ports == (7300,) and cascade._group.health_service == RECOMMENDER_HEALTH_SERVICE
    argv = cascade._command(0, 7300, tmp_path / "cascade-0.port")
    assert argv[3:5] == ["cascade", "serve"]
    assert [argv[argv.index(f) + 1] for f in ("--rankers", "--shards", "--host", "--port")] == ["127.0.0.2:7200,127.0.0.2:7201", "unix:/a.sock", "127.0.0.2", "7300"]


def test_a_group_binds_its_given_ports_and_a_restart_keeps_them(tmp_path: Path) -> None:
    world = FakeWorld(tmp_path / "group")
    group = world.group(2, ports=(7200, 7201))
    group.start()
    assert [argv[argv.index("--port") + 1] for argv, _, _ in world.spawned] == ["7200", "7201"]
    assert group.addresses == ["127.0.0.1:7200", "127.0.0.1:7201"]  # what the children reported
    group.restart(1)
    assert world.spawned[-1][0][world.spawned[-1][0].index("--port") + 1] == "7201"
    with pytest.raises(ConfigError, match=r"ports = \[7200\] is invalid: give one port per ranker \(2\)"):
        world.group(2, ports=(7200,))


@pytest.mark.parametrize("bad", [[], ["127.0.0.1:1,127.0.0.1:2"], [""]])
def test_the_cascade_needs_ranker_addresses(tmp_path: Path, bad: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"ranker_addresses = .* is invalid"):
        CascadeCluster(tmp_path / "spec.toml", tmp_path, bad, ["127.0.0.1:1"], data_root=tmp_path)


def test_shard_cluster_defaults_to_loopback(tmp_path: Path) -> None:
    argv = ShardCluster(tmp_path / "plan.json", tmp_path, num_shards=1)._command(0, 0, tmp_path / "p")
    assert argv[argv.index("--host") + 1] == "127.0.0.1"


def test_serve_refuses_a_spec_whose_tables_are_not_the_exports(tmp_path: Path) -> None:
    from recserve.cli.serve_cmd import _check_tables

    cfg = loads(BASE)
    _check_tables(cfg, [TableConfig("item", rows=1000, dim=16)], tmp_path / "spec.toml", tmp_path / "models")  # the same: fine
    for export, shown in [([TableConfig("item", rows=1200, dim=16)], "but 1,200 x 16"), ([TableConfig("item", rows=1000, dim=8)], "but 1,000 x 8"), ([], "but absent")]:
        with pytest.raises(ConfigError) as info:
            _check_tables(cfg, export, tmp_path / "spec.toml", tmp_path / "models")
        assert info.value.message.startswith(f"table 'item' is 1,000 x 16 in {tmp_path / 'spec.toml'} {shown} in the export {tmp_path / 'models'}"), info.value.message
    with pytest.raises(ConfigError, match="table 'extra' is absent in"):
        _check_tables(cfg, [TableConfig("item", rows=1000, dim=16), TableConfig("extra", rows=5, dim=4)], tmp_path / "spec.toml", tmp_path / "models")
