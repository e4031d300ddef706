"""The one validated config of a shard server process.

Wraps the cluster-wide :class:`~recserve.config.spec.ShardServerConfig` (limits, caches,
threads) with what is specific to one process: its shard id, plan, data directory,
listen address, DRAM tier dtype, admin token and the test-only fault hook. Built once at
the edge (CLI flags) and never mutated; derive variants with ``dataclasses.replace``.
"""

from __future__ import annotations

import dataclasses
import math

from recserve.config.spec import ShardServerConfig
from recserve.errors import require as _require

TIER_DTYPES = ("plan", "float32", "float16", "int8")


@dataclasses.dataclass(frozen=True)
class ShardProcessConfig:
    """Everything one ``recserve shard serve`` process needs.

    ``tier_dtype`` is the element type of the DRAM hot/warm tensors, ``"plan"`` for each
    table's dtype in the plan (RocksDB always keeps float32 rows, the source of truth). ``default_value`` fills the default row returned
    for a missing id. ``load_gate_file`` (test-only, needs ``fault_hook``) makes the
    server wait for that file to exist before it loads its tiers, so a test can observe
    health NOT_SERVING deterministically. ``load_from`` bulk-loads a source first (a no-op
    when the manifest records it); a new load into a store holding upserts newer than its
    last load is refused unless ``overwrite_upserts``.
    """

    shard_id: int
    plan_path: str
    data_dir: str
    host: str = "127.0.0.1"
    port: int = 0
    port_file: str | None = None
    metrics_port_file: str | None = None  # the bound /metrics port (server.metrics_port) is written here before gRPC listens
    unix_socket: str | None = None  # also listen on this Unix domain socket (co-located clients)
    server: ShardServerConfig = ShardServerConfig()
    tier_dtype: str = "plan"
    default_value: float = 0.0
    admin_token: str = ""  # Upsert needs 'authorization: Bearer <this>' metadata; "" = Upsert refused unless insecure_admin
    admin_token_env: str = "RECSERVE_ADMIN_TOKEN"  # where the token was read from (named in messages)
    insecure_admin: bool = False  # --insecure-admin: no token, Upsert open to every caller
    sync_writes: bool = False
    fault_hook: bool = False
    load_gate_file: str | None = None
    load_from: str | None = None
    overwrite_upserts: bool = False

    def __post_init__(self) -> None:
        _require(self.shard_id >= 0, "shard.shard_id", self.shard_id, "use a shard index >= 0 from the plan")
        _require(bool(self.plan_path), "shard.plan_path", self.plan_path, "pass --plan PLAN.json")
        _require(bool(self.data_dir), "shard.data_dir", self.data_dir, "pass --data DIR (the RocksDB directory)")
        _require(0 <= self.port <= 65535, "shard.port", self.port, "use a TCP port in 0..65535 (0 = pick a free one)")
        _require(self.tier_dtype in TIER_DTYPES, "shard.tier_dtype", self.tier_dtype, f"use one of {TIER_DTYPES}")
        _require(math.isfinite(self.default_value), "shard.default_value", self.default_value, "use a finite number")
        _require(
            self.load_gate_file is None or self.fault_hook,
            "shard.load_gate_file",
            self.load_gate_file,
            "the load gate is a test hook: enable it with --fault-hook or RECSERVE_FAULT_HOOK=1",
        )
