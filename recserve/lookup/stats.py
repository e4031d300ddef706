"""Counters and a time profile of the lookup client (read by tests and the benchmark)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class LookupStats:
    """Cumulative since the client started.

    ``ids_requested`` / ``ids_unique``: occurrences asked for vs unique rows per table
    per window (their ratio is the dedup ratio). ``rpcs_primary`` / ``rpcs_hedge``:
    lookup RPCs sent on routing vs as hedges or failover retries (``hedges_denied``:
    wanted but over budget); ``ids_sent``: ids those RPCs carried (ids per RPC = ids_sent
    / all RPCs). ``near_cache_lookups`` / ``near_cache_hits``: callers' id lookups (with
    repeats) that asked the near cache / that it answered; they survive plan refreshes,
    which rebuild the cache. ``missing``: id lookups answered with default rows because
    nothing arrived in time. Times are seconds summed over windows: ``prep_s`` (merge,
    dedup, near cache, routing), ``serialise_s`` (packing requests, decoding replies),
    ``rpc_wall_s`` (first send to last needed reply), ``scatter_s`` (rows into the
    window matrices), ``gather_s`` / ``pool_s`` (per-caller rows / embedding_bag).
    """

    windows: int = 0
    callers: int = 0
    callers_rejected: int = 0
    ids_requested: int = 0
    ids_unique: int = 0
    ids_fetched: int = 0
    rpcs_primary: int = 0
    rpcs_hedge: int = 0
    ids_sent: int = 0
    near_cache_lookups: int = 0
    near_cache_hits: int = 0
    hedges_denied: int = 0
    rpc_errors: int = 0
    missing: int = 0
    degraded_callers: int = 0
    plan_refreshes: int = 0
    prep_s: float = 0.0
    serialise_s: float = 0.0
    rpc_wall_s: float = 0.0
    scatter_s: float = 0.0
    gather_s: float = 0.0
    pool_s: float = 0.0

    @property
    def dedup_ratio(self) -> float:
        return self.ids_requested / self.ids_unique if self.ids_unique else 1.0

    @property
    def hedge_ratio(self) -> float:
        return self.rpcs_hedge / self.rpcs_primary if self.rpcs_primary else 0.0

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = dict(dataclasses.asdict(self))
        out["dedup_ratio"] = self.dedup_ratio
        out["hedge_ratio"] = self.hedge_ratio
        return out
