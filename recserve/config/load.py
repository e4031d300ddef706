"""Parse a TOML cluster spec into :class:`~recserve.config.spec.ClusterConfig`.

The embedded default (:data:`DEFAULT_SPEC`) needs no file. Unknown keys are errors
(a typo must not silently fall back to a default); every error names the field, the bad
value and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from recserve.config.spec import (
    AdminConfig,
    CascadeConfig,
    ClusterConfig,
    FeatureConfig,
    GatewayConfig,
    GenerationServiceConfig,
    LookupConfig,
    RankerConfig,
    RoutingConfig,
    ShardingConfig,
    ShardServerConfig,
    TableConfig,
    TenantConfig,
    TlsConfig,
    TopologyConfig,
)
from recserve.errors import ConfigError

DEFAULT_SPEC = """
# The embedded default cluster: the trained ranker tables of a 100k-item catalog (default
# users, categories and tags), served by 2 shards on loopback. Table names carry their
# model's prefix (dlrm_, tt_, l3_): trained tables, never the catalog's ground-truth
# vectors. `recserve train` writes the same layout sized to its catalog
# (MODELS/cluster.toml); ranker.models_dir names that export.
[[tables]]
name = "dlrm_user"
rows = 100000
dim = 32
pooling = "mean"

[[tables]]
name = "dlrm_item"
rows = 101024  # 100,000 catalog items + 1,024 rows reserved for items added later
dim = 32
pooling = "mean"

[[tables]]
name = "dlrm_category"
rows = 128
dim = 32
pooling = "mean"

[[tables]]
name = "dlrm_tag"
rows = 2048
dim = 32
pooling = "mean"

[[tables]]
name = "dlrm_category_cross"
rows = 16384
dim = 32
pooling = "mean"

[[tables]]
name = "tt_item"
rows = 101024  # 100,000 catalog items + 1,024 rows reserved for items added later
dim = 16
pooling = "mean"

[[tables]]
name = "tt_category"
rows = 128
dim = 128
pooling = "mean"

[[tables]]
name = "l3_item"
rows = 101024  # 100,000 catalog items + 1,024 rows reserved for items added later
dim = 16
pooling = "mean"

[[tables]]
name = "l3_category"
rows = 128
dim = 16
pooling = "mean"

[[tables]]
name = "l3_tag"
rows = 2048
dim = 16
pooling = "mean"

[[features]]
name = "dlrm_user_id"
table = "dlrm_user"

[[features]]
name = "dlrm_candidate_item"
table = "dlrm_item"

[[features]]
name = "dlrm_history_items"
table = "dlrm_item"

[[features]]
name = "dlrm_candidate_category"
table = "dlrm_category"

[[features]]
name = "dlrm_history_categories"
table = "dlrm_category"

[[features]]
name = "dlrm_candidate_tags"
table = "dlrm_tag"

[[features]]
name = "dlrm_category_cross"
table = "dlrm_category_cross"

[[features]]
name = "tt_history_items"
table = "tt_item"

[[features]]
name = "tt_history_categories"
table = "tt_category"

[[features]]
name = "l3_candidate_item"
table = "l3_item"

[[features]]
name = "l3_candidate_category"
table = "l3_category"

[[features]]
name = "l3_candidate_tags"
table = "l3_tag"

[[features]]
name = "l3_history_items"
table = "l3_item"

[[features]]
name = "l3_history_categories"
table = "l3_category"

[sharding]
num_shards = 2
hot_fraction = 0.01
warm_fraction = 0.10
hot_replicas = 2

[lookup]
window_ms = 1.0

[ranker]
models = ["dlrm", "two_tower", "l3"]
models_dir = "models"

[cascade]
# Stage sizes (reference Table 28, L1 doubled: see CascadeConfig.l1_out): L0 keeps 1% of
# the catalog (l0_out = 0 = auto), at least L1's 2,000, then 2,000 -> 100 -> 10 (l3_out is the default k).
l0_out = 0
l1_out = 2000
l2_out = 100
l3_out = 10
default_deadline_ms = 100.0
reply_margin_ms = 3.0
budget_shares = [0.15, 0.15, 0.45, 0.25]
index_factory = "auto"
log_path = ""

# What `recserve serve` starts: shards (sharding.num_shards), 2 rankers, the cascade
# and 1 generation replica, all on loopback, each on a free port ("7100-7199" pins a range).
[topology]
rankers = 2
host = "127.0.0.1"
shard_ports = "0"
ranker_ports = "0"
cascade_port = 0
unix_sockets = false
generators = 1  # Generation replicas behind the gateway's /v1/generate (0 = none)
generator_ports = "0"

# Tenants of the HTTP gateway. `default` needs no API key (api_key_env = ""), so a first
# curl works; a keyed tenant names the environment variable that holds its key (the key
# never sits here) and may carry quotas:
#   [[tenants]]
#   name = "feed"
#   api_key_env = "FEED_API_KEY"
#   rate_per_s = 200.0
#   burst = 50
#   max_concurrent_requests = 32
[[tenants]]
name = "default"
api_key_env = ""
"""

T = TypeVar("T")


# What a field of each Python type must look like in TOML, as the fix in an error message.
_TYPE_FIX: dict[type, str] = {
    int: "use an integer (no quotes, no decimal point)",
    float: "use a number (no quotes)",
    str: "use a quoted string",
    bool: "use true or false",
}


def _is_number(value: Any) -> bool:
    # bool is an int subclass in Python, but `rows = true` is never meant as 1.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _coerce(field: str, value: Any, hint: Any) -> Any:
    """Check one TOML value against its dataclass field type; return it converted
    (ints to float for float fields, lists to tuples). Raises ConfigError naming
    ``field``, the value and the fix."""
    if typing.get_origin(hint) is tuple and typing.get_args(hint)[0] is str:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{field} = {value!r} is invalid: use a list of quoted strings, e.g. [\"dlrm\", \"l3\"]")
        return tuple(value)
    if typing.get_origin(hint) is tuple:
        items = value if isinstance(value, list) else None
        if items is None or not all(_is_number(v) for v in items):
            raise ConfigError(f"{field} = {value!r} is invalid: use a list of numbers, e.g. [0.25, 0.25, 0.25, 0.25]")
        return tuple(float(v) for v in items)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        # An optional override (`float | None`): TOML has no null, so a given value must
        # be of the non-None type.
        (hint,) = [h for h in typing.get_args(hint) if h is not type(None)]
    if hint is float:
        if not _is_number(value):
            raise ConfigError(f"{field} = {value!r} is invalid: {_TYPE_FIX[float]}")
        if math.isnan(value):
            raise ConfigError(f"{field} = nan is invalid: use a real number (nan compares false with every bound)")
        return float(value)
    if hint is int and not (isinstance(value, int) and not isinstance(value, bool)):
        raise ConfigError(f"{field} = {value!r} is invalid: {_TYPE_FIX[int]}")
    if hint in (str, bool) and not isinstance(value, hint):
        raise ConfigError(f"{field} = {value!r} is invalid: {_TYPE_FIX[hint]}")
    return value


def _build(cls: type[T], section: str, raw: Any, header: str) -> T:
    """Build one config dataclass from a TOML table ``raw`` found at ``section``
    (``header`` is how the user writes it: ``[sharding]``, ``[[tables]]``). Unknown keys,
    missing required keys and values of the wrong type are ConfigErrors naming the field;
    range checks are the dataclass's own ``__post_init__``."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{section} = {raw!r} is invalid: write it as a TOML table ({header} followed by key = value lines)")
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    known = {f.name for f in fields}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{section}.{unknown[0]} = {raw[unknown[0]]!r} is not a known key; valid keys: {sorted(known)}")
    hints = typing.get_type_hints(cls)
    for f in fields:
        if f.name not in raw and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            fix = _TYPE_FIX.get(hints[f.name], "set it")
            raise ConfigError(f"{section}.{f.name} is missing: add `{f.name} = ...` under {header}; {fix}")
    kwargs = {key: _coerce(f"{section}.{key}", value, hints[key]) for key, value in raw.items()}
    return cls(**kwargs)


def _entries(raw: dict[str, Any], key: str) -> list[Any]:
    """The entries of an array-of-tables section (``[[tables]]``); absent = none."""
    value = raw.get(key, [])
    if not isinstance(value, list):
        raise ConfigError(f"{key} = {value!r} is invalid: declare each entry as its own [[{key}]] table (double brackets)")
    return value


def parse_spec(raw: dict[str, Any]) -> ClusterConfig:
    """Build a validated ClusterConfig from an already-parsed TOML document."""
    top_known = {f.name for f in dataclasses.fields(ClusterConfig)}
    unknown = sorted(set(raw) - top_known)
    if unknown:
        raise ConfigError(f"{unknown[0]} = {raw[unknown[0]]!r} is not a known section; valid sections: {sorted(top_known)}")
    tables = tuple(_build(TableConfig, f"tables[{i}]", t, "[[tables]]") for i, t in enumerate(_entries(raw, "tables")))
    features = tuple(_build(FeatureConfig, f"features[{i}]", f, "[[features]]") for i, f in enumerate(_entries(raw, "features")))
    tenants = tuple(_build(TenantConfig, f"tenants[{i}]", t, "[[tenants]]") for i, t in enumerate(_entries(raw, "tenants")))
    addresses = raw.get("shard_addresses", [])
    if not isinstance(addresses, list) or not all(isinstance(a, str) and ":" in a for a in addresses):
        raise ConfigError(f"shard_addresses = {addresses!r} is invalid: give a list of 'host:port' strings")

    def section(cls: type[T], name: str) -> T:
        return _build(cls, name, raw.get(name, {}), f"[{name}]")

    return ClusterConfig(
        tables=tables,
        features=features,
        sharding=section(ShardingConfig, "sharding"),
        shard_addresses=tuple(addresses),
        shard_server=section(ShardServerConfig, "shard_server"),
        lookup=section(LookupConfig, "lookup"),
        ranker=section(RankerConfig, "ranker"),
        routing=section(RoutingConfig, "routing"),
        cascade=section(CascadeConfig, "cascade"),
        gateway=section(GatewayConfig, "gateway"),
        tenants=tenants,
        topology=section(TopologyConfig, "topology"),
        generation=section(GenerationServiceConfig, "generation"),
        admin=section(AdminConfig, "admin"),
        tls=section(TlsConfig, "tls"),
    )


def loads(text: str) -> ClusterConfig:
    """Parse TOML text. A syntax error names the line and column."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"cluster spec is not valid TOML: {exc}; fix the syntax at that position") from exc
    return parse_spec(raw)


def load(path: str | Path | None = None) -> ClusterConfig:
    """Load a spec file, or the embedded default when ``path`` is None."""
    if path is None:
        return loads(DEFAULT_SPEC)
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"cluster spec path = {str(p)!r} is invalid: no such file; pass an existing TOML file or omit it for the embedded default")
    return loads(p.read_text())


def default_config() -> ClusterConfig:
    return loads(DEFAULT_SPEC)
