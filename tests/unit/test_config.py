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
    # Trained tables, model-prefixed: no default table is named like a catalog's ground truth.
    assert [t.name for t in cfg.tables] == ["dlrm_user", "dlrm_item", "dlrm_category", "dlrm_tag", "dlrm_category_cross", "tt_item", "tt_category", "l3_item", "l3_category", "l3_tag"]
    assert cfg.features_of("dlrm_item") == ["dlrm_candidate_item", "dlrm_history_items"]  # one table, two features
    assert cfg.ranker.models_dir == "models"
    assert cfg.sharding.num_shards == 2


def test_minimal_spec_parses() -> None:
    cfg = loads(BASE)
    assert cfg.table("item").rows == 1000
    assert cfg.features[0].table == "item"


@pytest.mark.parametrize(
    "extra, field, value, fix",
    [
        ("[sharding]\nnum_shards = 0\n", "sharding.num_shards", "0", "at least 1 shard"),
        ("[sharding]\nhot_fraction = 1.5\n", "sharding.hot_fraction", "1.5", "fraction in [0, 1]"),
        ("[sharding]\nnum_shards = 2\nhot_replicas = 3\n", "sharding.hot_replicas", "3", "1..num_shards (2)"),
        ("[lookup]\nwindow_ms = -1.0\n", "lookup.window_ms", "-1.0", "use 0..max_window_ms"),
        ("[cascade]\nbudget_shares = [0.5, 0.5, 0.5, 0.5]\n", "cascade.budget_shares", "0.5", "sum to 1.0"),
        ("[gateway]\nport = 70000\n", "gateway.port", "70000", "0..65535"),
        ("[[tenants]]\nname = \"a\"\npriority = \"urgent\"\n", "tenants.a.priority", "urgent", "use one of"),
        ("[sharding]\nnum_shard = 3\n", "sharding.num_shard", "3", "valid keys"),
        ("shard_addresses = [\"127.0.0.1:1\"]\n", "shard_addresses", "127.0.0.1:1", "exactly sharding.num_shards (2)"),
        # Wrong TOML types: named by the loader before any range check compares them.
        ("[sharding]\nnum_shards = \"two\"\n", "sharding.num_shards", "'two'", "use an integer"),
        ("[sharding]\nnum_shards = 2.5\n", "sharding.num_shards", "2.5", "use an integer"),
        ("[lookup]\nwindow_ms = \"1ms\"\n", "lookup.window_ms", "'1ms'", "use a number"),
        ("[lookup]\nhedge_budget = nan\n", "lookup.hedge_budget", "nan", "real number"),
        ("[gateway]\nhost = 5\n", "gateway.host", "5", "quoted string"),
        ("[cascade]\nbudget_shares = \"even\"\n", "cascade.budget_shares", "'even'", "list of numbers"),
        ("[gateway]\nport = true\n", "gateway.port", "True", "use an integer"),
        ("sharding = 3\n", "sharding", "3", "TOML table ([sharding]"),
        ("tenants = 3\n", "tenants", "3", "[[tenants]]"),
    ],
)
def test_bad_values_name_field_value_and_fix(extra: str, field: str, value: str, fix: str) -> None:
    # `extra` goes first: a top-level key written after BASE would land in its last
    # [[features]] table and fail as an unknown feature key instead.
    with pytest.raises(ConfigError) as info:
        loads(extra + BASE)
    msg = str(info.value)
    assert f"{field} = " in msg and value in msg and fix in msg, msg


def test_missing_and_mistyped_table_keys_are_named() -> None:
    with pytest.raises(ConfigError, match=r"tables\[0\]\.dim is missing: add `dim = \.\.\.` under \[\[tables\]\]; use an integer"):
        loads(BASE.replace("dim = 16\n", ""))
    with pytest.raises(ConfigError, match=r"features\[0\]\.table is missing"):
        loads(BASE.replace('table = "item"\n', ""))
    with pytest.raises(ConfigError, match=r"tables\[0\]\.rows = 1000\.0 is invalid: use an integer"):
        loads(BASE.replace("rows = 1000", "rows = 1000.0"))
    with pytest.raises(ConfigError, match=r"tables\[0\]\.name = 5 is invalid: use a quoted string"):
        loads(BASE.replace('name = "item"', "name = 5"))
    with pytest.raises(ConfigError, match=r"tables = \{.*\} is invalid: declare each entry as its own \[\[tables\]\]"):
        loads(BASE.replace("[[tables]]", "[tables]"))


def test_integer_toml_values_become_floats_for_float_fields() -> None:
    cfg = loads(BASE + "[lookup]\nwindow_ms = 1\nmax_window_ms = 2\n[cascade]\nbudget_shares = [1, 0, 0, 0]\n")
    assert type(cfg.lookup.window_ms) is float and cfg.lookup.window_ms == 1.0
    assert cfg.cascade.budget_shares == (1.0, 0.0, 0.0, 0.0) and all(type(s) is float for s in cfg.cascade.budget_shares)


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


@pytest.mark.parametrize(
    "extra, field, value, fix",
    [
        ("l0_out = 500\n", "cascade.l0_out", "500", "0 (auto from the catalog size) or at least l1_out (2000)"),
        ("l1_out = 50\n", "cascade.l1_out..l3_out", "(50, 100, 10)", "l1_out >= l2_out >= l3_out"),
        ("l3_out = 0\n", "cascade.l1_out..l3_out", "(2000, 100, 0)", "positive stage sizes"),
        ("l0_fraction = 0.0\n", "cascade.l0_fraction", "0.0", "fraction of the catalog in (0, 1]"),
        ("max_k = 5\n", "cascade.max_k", "5", "at least l3_out (10)"),
        ("reply_margin_ms = 150\n", "cascade.reply_margin_ms", "150.0", "0..default_deadline_ms (100.0)"),
        ("reply_margin_ms = -1\n", "cascade.reply_margin_ms", "-1.0", "0..default_deadline_ms"),
        ("min_stage_ms = -0.5\n", "cascade.min_stage_ms", "-0.5", ">= 0 ms"),
        ("cost_alpha = 0\n", "cascade.cost_alpha", "0.0", "EWMA weight in (0, 1]"),
        ("cost_quantile = 0.3\n", "cascade.cost_quantile", "0.3", "0 (no safety margin) or a quantile in [0.5, 1)"),
        ("cost_prior_fixed_ms = [1, 2, 3]\n", "cascade.cost_prior_fixed_ms", "(1.0, 2.0, 3.0)", "4 finite costs >= 0 (L0..L3)"),
        ("cost_prior_per_item_us = [1, -2, 3, 4]\n", "cascade.cost_prior_per_item_us", "-2.0", "4 finite costs >= 0"),
        ("probe_after_skips = -1\n", "cascade.probe_after_skips", "-1", "0 = never probe"),
        ("index_factory = \"IVF64, PQ8\"\n", "cascade.index_factory", "'IVF64, PQ8'", "faiss factory string without spaces"),
        ("index_factory = 5\n", "cascade.index_factory", "5", "quoted string"),
        ("nprobe = -2\n", "cascade.nprobe", "-2", "0 (the index's default)"),
        ("ef_search = -2\n", "cascade.ef_search", "-2", "0 (the index's default)"),
        ("popular_per_category = 0\n", "cascade.popular_per_category", "0", "at least 1 item per category"),
        ("log_max_bytes = 10\n", "cascade.log_max_bytes", "10", "at least 4096 bytes"),
        ("log_backups = 0\n", "cascade.log_backups", "0", "at least 1 rotated file"),
        ("log_path = 3\n", "cascade.log_path", "3", "quoted string"),
        ("nprobe = 1.5\n", "cascade.nprobe", "1.5", "use an integer"),
    ],
)
def test_bad_cascade_values_name_field_value_and_fix(extra: str, field: str, value: str, fix: str) -> None:
    with pytest.raises(ConfigError) as info:
        loads(BASE + "[cascade]\n" + extra)
    msg = str(info.value)
    assert f"{field} = " in msg and value in msg and fix in msg, msg


def test_cascade_defaults_and_overrides_parse() -> None:
    cfg = default_config().cascade
    assert (cfg.l0_out, cfg.l1_out, cfg.l2_out, cfg.l3_out) == (0, 2000, 100, 10)  # l0 auto: 1% of the catalog
    assert (cfg.reply_margin_ms, cfg.default_deadline_ms, cfg.index_factory, cfg.log_path) == (3.0, 100.0, "auto", "")
    c = loads(BASE + '[cascade]\nl0_out = 5000\nreply_margin_ms = 2\ncost_prior_fixed_ms = [1, 1, 4, 4]\nindex_factory = "IVF256,PQ16"\nnprobe = 16\nlog_path = "/tmp/impressions.log"\n').cascade
    assert (c.l0_out, c.reply_margin_ms, c.index_factory, c.nprobe, c.log_path) == (5000, 2.0, "IVF256,PQ16", 16, "/tmp/impressions.log")
    assert c.cost_prior_fixed_ms == (1.0, 1.0, 4.0, 4.0) and type(c.cost_prior_fixed_ms[0]) is float


def test_the_cascade_never_sends_a_ranker_more_candidates_than_it_takes() -> None:
    base = default_config()
    with pytest.raises(ConfigError) as err:
        dataclasses.replace(base, ranker=dataclasses.replace(base.ranker, max_candidates=512, max_batch_candidates=4096))
    assert "cascade.l1_out / cascade.max_k = 2000" in str(err.value) and "ranker.max_candidates (512)" in str(err.value)


def test_the_default_item_tables_hold_the_catalog_plus_the_exports_reserved_rows() -> None:
    from ranker.export import NEW_ITEM_ROWS

    rows = {t.name: t.rows for t in default_config().tables}
    assert rows["dlrm_item"] == rows["tt_item"] == rows["l3_item"] == 100_000 + NEW_ITEM_ROWS == rows["dlrm_user"] + NEW_ITEM_ROWS
