"""The one validated config object of the feature-parallel lookup client.

It bundles what the client needs from the cluster spec (tables, features, the
:class:`~recserve.config.spec.LookupConfig` window/hedge/near-cache knobs) with the
client-only knobs that the cluster spec does not carry (wire dtype, shard-side partial
pooling, breaker and hedge-budget shape). Build it from a cluster spec with
:meth:`LookupClientConfig.from_cluster`; derive variants with ``dataclasses.replace``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from recserve.config.spec import ClusterConfig, FeatureConfig, LookupConfig, ShardServerConfig, TableConfig
from recserve.errors import ConfigError
from recserve.errors import require as _require

WIRE_DTYPES = ("float32", "float16", "int8")


@dataclasses.dataclass(frozen=True)
class LookupClientConfig:
    """Everything one :class:`~recserve.lookup.client.LookupClient` needs.

    ``row_dtype`` is the dtype rows travel in (the shard converts; the client decodes
    to fp32). ``partial_pooling`` asks shards for fp32 partial sums per bag instead of
    rows when every caller of a window wants pooled output (fewer bytes when bags are
    long; summation order changes, so results match TorchRec within a tolerance, not
    bit-exactly; such windows bypass the near cache, whose rows would have to be
    pooled apart from the shards' partial sums). ``min_ids_per_extra_rpc``: hot ids that would open an RPC to a shard
    the window does not otherwise contact go to an already-contacted replica when
    fewer than this many would travel (an RPC costs about as much as moving a few
    hundred rows here). ``hedge_min_ms`` floors the hedge delay so a shard with a tiny
    recent latency is not hedged on noise; ``hedge_burst`` is the token-bucket depth of
    the hedge budget (``lookup.hedge_budget`` is its long-run ratio).
    ``breaker_failures`` consecutive retryable failures open a shard's breaker for
    ``breaker_open_ms``, after which one probe window may use it again.
    ``max_ids_per_rpc`` is the shards' limit (``shard_server.max_ids_per_rpc``, which
    :meth:`from_cluster` copies; a shard answers RESOURCE_EXHAUSTED above it): a window
    with more ids for one shard sends them in several RPCs of at most this many ids.
    """

    tables: tuple[TableConfig, ...]
    features: tuple[FeatureConfig, ...]
    lookup: LookupConfig = LookupConfig()
    row_dtype: str = "float32"
    partial_pooling: bool = False
    min_ids_per_extra_rpc: int = 64
    hedge_min_ms: float = 2.0
    hedge_burst: float = 10.0
    breaker_failures: int = 3
    breaker_open_ms: float = 500.0
    rpc_timeout_ms: float = 1000.0
    max_ids_per_rpc: int = ShardServerConfig.max_ids_per_rpc
    # A window closes this long before the tightest caller's deadline minus the
    # measured window time: an event loop busy with RPC replies (on a loaded 2-core box)
    # wakes a few milliseconds late, and a caller still queued at its deadline gets
    # nothing but default rows.
    dispatch_margin_ms: float = 5.0
    admin_token: str = ""
    # Windows with more ids than this prepare and reassemble on a worker thread (numpy
    # and torch release the GIL); smaller ones stay on the event loop, where a thread
    # hop would cost more than the work.
    offload_ids: int = 16384

    def __post_init__(self) -> None:
        _require(len(self.tables) > 0, "lookup_client.tables", list(self.tables), "give at least one table")
        names = [t.name for t in self.tables]
        _require(len(set(names)) == len(names), "lookup_client.tables[].name", names, "table names must be unique")
        fnames = [f.name for f in self.features]
        _require(len(fnames) > 0, "lookup_client.features", fnames, "map at least one feature to a table")
        _require(len(set(fnames)) == len(fnames), "lookup_client.features[].name", fnames, "feature names must be unique")
        for f in self.features:
            _require(f.table in names, f"lookup_client.features.{f.name}.table", f.table, f"name one of the tables {names}")
        _require(self.row_dtype in WIRE_DTYPES, "lookup_client.row_dtype", self.row_dtype, f"use one of {WIRE_DTYPES}")
        _require(self.min_ids_per_extra_rpc >= 0, "lookup_client.min_ids_per_extra_rpc", self.min_ids_per_extra_rpc, "use >= 0 ids")
        _require(self.hedge_min_ms >= 0, "lookup_client.hedge_min_ms", self.hedge_min_ms, "use >= 0 ms")
        _require(self.hedge_burst >= 0, "lookup_client.hedge_burst", self.hedge_burst, "use >= 0 tokens")
        _require(self.breaker_failures >= 1, "lookup_client.breaker_failures", self.breaker_failures, "use at least 1 failure")
        _require(self.breaker_open_ms > 0, "lookup_client.breaker_open_ms", self.breaker_open_ms, "use a positive duration in ms")
        _require(self.rpc_timeout_ms > 0, "lookup_client.rpc_timeout_ms", self.rpc_timeout_ms, "use a positive timeout in ms")
        _require(self.max_ids_per_rpc > 0, "lookup_client.max_ids_per_rpc", self.max_ids_per_rpc, "use a positive id count (the shards' shard_server.max_ids_per_rpc)")
        _require(self.dispatch_margin_ms >= 0, "lookup_client.dispatch_margin_ms", self.dispatch_margin_ms, "use >= 0 ms")
        _require(self.offload_ids >= 0, "lookup_client.offload_ids", self.offload_ids, "use >= 0 ids")

    @classmethod
    def from_cluster(cls, cluster: ClusterConfig, **overrides: Any) -> "LookupClientConfig":
        """The client config of ``cluster`` (its tables, features, ``lookup`` section and
        the shards' ``shard_server.max_ids_per_rpc``)."""
        overrides.setdefault("max_ids_per_rpc", cluster.shard_server.max_ids_per_rpc)
        return cls(tables=cluster.tables, features=cluster.features, lookup=cluster.lookup, **overrides)

    def table(self, name: str) -> TableConfig:
        for t in self.tables:
            if t.name == name:
                return t
        raise ConfigError(f"table {name!r} is not declared; declared tables: {[t.name for t in self.tables]}")

    def table_of_feature(self) -> dict[str, str]:
        return {f.name: f.table for f in self.features}
