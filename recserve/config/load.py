"""Parse a TOML cluster spec into :class:`~recserve.config.spec.ClusterConfig`.

The embedded default (:data:`DEFAULT_SPEC`) needs no file. Unknown keys are errors
(a typo must not silently fall back to a default); every error names the field, the bad
value and the fix.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any, TypeVar

from recserve.config.spec import (
    CascadeConfig,
    ClusterConfig,
    FeatureConfig,
    GatewayConfig,
    LookupConfig,
    RankerConfig,
    ShardingConfig,
    ShardServerConfig,
    TableConfig,
    TenantConfig,
)
from recserve.errors import ConfigError

DEFAULT_SPEC = """
# The embedded default cluster: a small catalog served by 2 shards on loopback.
[[tables]]
name = "item"
rows = 100000
dim = 64
pooling = "sum"

[[tables]]
name = "category"
rows = 1000
dim = 64
pooling = "mean"

[[features]]
name = "history_items"
table = "item"

[[features]]
name = "candidate_item"
table = "item"

[[features]]
name = "history_categories"
table = "category"

[sharding]
num_shards = 2
hot_fraction = 0.01
warm_fraction = 0.10
hot_replicas = 2

[lookup]
window_ms = 1.0

[cascade]
default_deadline_ms = 100.0

[[tenants]]
name = "default"
"""

T = TypeVar("T")


def _build(cls: type[T], section: str, raw: Any) -> T:
    if not isinstance(raw, dict):
        raise ConfigError(f"{section} = {raw!r} is invalid: it must be a TOML table ([{section}])")
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{section}.{unknown[0]} = {raw[unknown[0]]!r} is not a known key; valid keys: {sorted(known)}")
    kwargs = dict(raw)
    for key, value in kwargs.items():
        if isinstance(value, list):
            kwargs[key] = tuple(value)
    try:
        return cls(**kwargs)
    except TypeError as exc:  # wrong type of value reaching a comparison
        raise ConfigError(f"{section} = {raw!r} is invalid: {exc}") from exc


def parse_spec(raw: dict[str, Any]) -> ClusterConfig:
    """Build a validated ClusterConfig from an already-parsed TOML document."""
    top_known = {f.name for f in dataclasses.fields(ClusterConfig)}
    unknown = sorted(set(raw) - top_known)
    if unknown:
        raise ConfigError(f"{unknown[0]} = {raw[unknown[0]]!r} is not a known section; valid sections: {sorted(top_known)}")
    tables = tuple(_build(TableConfig, f"tables[{i}]", t) for i, t in enumerate(raw.get("tables", [])))
    features = tuple(_build(FeatureConfig, f"features[{i}]", f) for i, f in enumerate(raw.get("features", [])))
    tenants = tuple(_build(TenantConfig, f"tenants[{i}]", t) for i, t in enumerate(raw.get("tenants", [])))
    addresses = raw.get("shard_addresses", [])
    if not isinstance(addresses, list) or not all(isinstance(a, str) and ":" in a for a in addresses):
        raise ConfigError(f"shard_addresses = {addresses!r} is invalid: give a list of 'host:port' strings")
    return ClusterConfig(
        tables=tables,
        features=features,
        sharding=_build(ShardingConfig, "sharding", raw.get("sharding", {})),
        shard_addresses=tuple(addresses),
        shard_server=_build(ShardServerConfig, "shard_server", raw.get("shard_server", {})),
        lookup=_build(LookupConfig, "lookup", raw.get("lookup", {})),
        ranker=_build(RankerConfig, "ranker", raw.get("ranker", {})),
        cascade=_build(CascadeConfig, "cascade", raw.get("cascade", {})),
        gateway=_build(GatewayConfig, "gateway", raw.get("gateway", {})),
        tenants=tenants,
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
