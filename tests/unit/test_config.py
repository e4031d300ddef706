from __future__ import annotations

import dataclasses

import pytest

from recserve.config import ShardingConfig, default_config, loads
from recserve.errors import ConfigError

BASE = """
[[tables]]
name = "item"
rows = 1000
dim = 16

[[features]]
name = "history"
table = "item"
"""


def test_embedded_default_needs_no_file() -> None:
    cfg = default_config()
    assert [t.name for t in cfg.tables] == ["item", "category"]
    assert cfg.features_of("item") == ["history_items", "candidate_item"]  # one table, two features
    assert cfg.sharding.num_shards == 2


def test_minimal_spec_parses() -> None:
    cfg = loads(BASE)
    assert cfg.table("item").rows == 1000
    assert cfg.features[0].table == "item"


@pytest.mark.parametrize(
    "extra, field, value",
    [
        ("[sharding]\nnum_shards = 0\n", "sharding.num_shards", "0"),
        ("[sharding]\nhot_fraction = 1.5\n", "sharding.hot_fraction", "1.5"),
        ("[sharding]\nnum_shards = 2\nhot_replicas = 3\n", "sharding.hot_replicas", "3"),
        ("[lookup]\nwindow_ms = -1.0\n", "lookup.window_ms", "-1.0"),
        ("[cascade]\nbudget_shares = [0.5, 0.5, 0.5, 0.5]\n", "cascade.budget_shares", "0.5"),
        ("[gateway]\nport = 70000\n", "gateway.port", "70000"),
        ("[[tenants]]\nname = \"a\"\npriority = \"urgent\"\n", "tenants.a.priority", "urgent"),
        ("[sharding]\nnum_shard = 3\n", "sharding.num_shard", "3"),
        ("shard_addresses = [\"127.0.0.1:1\"]\n", "shard_addresses", "127.0.0.1:1"),
    ],
)
def test_bad_values_name_field_and_value(extra: str, field: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        loads(BASE + extra)
    msg = str(info.value)
    assert field in msg and value in msg


def test_bad_table_fields() -> None:
    with pytest.raises(ConfigError, match=r"tables\.item\.dim = 0"):
        loads(BASE.replace("dim = 16", "dim = 0"))
    with pytest.raises(ConfigError, match=r"tables\.item\.dtype = 'bf13'.*float32"):
        loads(BASE.replace("dim = 16", 'dim = 16\ndtype = "bf13"'))


def test_feature_must_name_known_table() -> None:
    with pytest.raises(ConfigError, match=r"features\.history\.table = 'nope'.*\['item'\]"):
        loads(BASE.replace('table = "item"', 'table = "nope"'))


def test_toml_syntax_error_is_config_error() -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        loads("[[tables]\nname=")


def test_configs_are_frozen_and_derivable() -> None:
    s = ShardingConfig(num_shards=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.num_shards = 5  # type: ignore[misc]
    t = dataclasses.replace(s, num_shards=8)
    assert (s.num_shards, t.num_shards) == (4, 8)
    with pytest.raises(ConfigError, match="sharding.hot_replicas = 4"):
        dataclasses.replace(s, num_shards=3, hot_replicas=4)
