"""Capacity simulator: what a sharding spec costs at 10**9 rows, from closed forms
(``recserve plan simulate``; docs/architecture.md §4, "Capacity simulator").

:func:`~recserve.sharding.estimates.estimate_plan` sweeps a dense ``probs[rows]`` array
through a real plan's router (8 GB of float64 at 10**9 rows). This module answers the
same questions with nothing allocated per row, for a Zipf(``a``) popularity whose
rank ``r`` (1-based) has ``p_r = r**-a / H(R, a)`` and the planner's tier rule (the top
``round(hot_fraction * R)`` ranks hot, the next ``round(warm_fraction * R)`` warm).

**Rank sums.** Every figure is a sum ``Σ_{r=lo..hi} g(r)`` of a smooth function of the
rank (``p``, ``q = 1 - (1 - p)**L``, ``q**2``, ``log(1 - q f)``). Ranks up to
``head_ranks`` (2**17) are summed exactly, as arrays; the tail by the midpoint rule
``Σ_{r=a..b} g(r) ≈ ∫_{a-1/2}^{b+1/2} g(x) dx`` with Gauss-Legendre quadrature in
``log x`` (relative error < 1e-6 against the dense sums, see the tests). Memory is
bounded by the head and the quadrature nodes whatever ``R`` is.

**Traffic model** (the one :mod:`recserve.sharding.estimates` documents). A window
holds ``L`` i.i.d. lookups and is deduplicated, so rank ``r`` is sent with probability
``q_r``. A balanced ring gives every shard ``1/S`` of the ids (within one token piece),
so per shard and window the expected (slice-)rows served are
``(U_hot + C * U_warm + U_cold) / S`` with ``U_tier = Σ q_r`` over the tier. Imbalance
comes from which shards the popular ids hash to: shard ``s``'s expected load is a sum
of independent placements (cold: weight ``q`` with probability ``1/S``; warm: ``q``
with ``C/S``; hot: ``q/R`` with ``R/S``; the probabilities are the balanced ring's
actual shares), whose variance is closed-form. The loads sum to a constant, so they
are ``mu_s + Y_s - mean(Y)`` for independent normal ``Y_s`` of variance
``σ_s² · S / (S - 1)``, and the imbalance is ``E[max_s (mu_s + Y_s)] / mean``
(:func:`expected_max`, one quadrature). A shard gets an RPC in a window
unless all ``L`` draws miss it: a draw lands on shard ``s`` with probability ``X_s``
(the summed ``p`` of the ids it owns, holds a slice of, or serves as the chosen hot
replica), so ``P[no RPC] = E[(1 - X_s)**L]``, taken to second order in ``X_s``'s
placement variance.

**Bytes** follow :mod:`recserve.sharding.estimates` (DRAM row + 8 B index, RocksDB row
+ 24 B), as expected per-shard means. **Remap on +1 shard**: cold ids move when the
newcomer owns them, ``1/(S+1)``; a hot id's replica set (owner, owner+1, ... mod S)
changes when its owner moves or wraps: ``R/(S+1)``; a warm id's slices: ``C/(S+1)``.

**Network** per shard: requests carry 8 B per id, replies the row in the table's dtype
plus the ``found`` / ``not_owned`` bytes, and each RPC ~``RPC_OVERHEAD_BYTES`` of
framing; a model, not a measurement.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from recserve.config.spec import ShardingConfig
from recserve.errors import ConfigError
from recserve.sharding.estimates import DRAM_INDEX_BYTES_PER_ROW, ROCKSDB_OVERHEAD_BYTES_PER_ROW, slice_row_bytes
from recserve.sharding.planner import resolve_column_splits
from recserve.sharding.ring import Ring, balanced_tokens
from recserve.sharding.router import DENSE_MAP_MAX_ROWS, routing_memory_bytes

HEAD_RANKS = 1 << 17  # ranks summed exactly; the tail is integrated
_GL_NODES, _GL_WEIGHTS = np.polynomial.legendre.leggauss(24)
_PANELS_PER_DECADE = 8
RPC_OVERHEAD_BYTES = 96  # HTTP/2 frames + gRPC / protobuf headers per RPC, request + reply
REPLY_MASK_BYTES_PER_ROW = 2  # found + not_owned, one byte each
# A shard's per-table index, sized to the rows it owns (embedding_server.table):
# sorted int64 id + uint8 residence + int32 slot per owned (slice-)row, and the cold
# row cache's int32 slot per owned cold row.
SHARD_INDEX_BYTES_PER_OWNED_ROW = 8 + 1 + 4
SHARD_CACHE_INDEX_BYTES_PER_COLD_ROW = 4
LANDED_SHARD_INDEX_BYTES_PER_TABLE_ROW = 9  # before: code u8 + slot i32 + cache i32 over every row


def rank_sum(g: Callable[[np.ndarray], np.ndarray], lo: int, hi: int, head_ranks: int = HEAD_RANKS) -> float:
    """``Σ_{r=lo..hi} g(r)`` over 1-based ranks: exact up to ``head_ranks``, midpoint
    rule + Gauss-Legendre in ``log x`` above. ``g`` maps float64 ranks [N] to [N]."""
    if hi < lo:
        return 0.0
    total = 0.0
    head_end = min(hi, head_ranks)
    if lo <= head_end:
        total += float(np.sum(g(np.arange(lo, head_end + 1, dtype=np.float64))))
    a = max(lo, head_end + 1)
    if a <= hi:
        u0, u1 = math.log(a - 0.5), math.log(hi + 0.5)
        panels = max(1, math.ceil((u1 - u0) / math.log(10) * _PANELS_PER_DECADE))
        edges = np.linspace(u0, u1, panels + 1)
        half = (edges[1:] - edges[:-1])[:, None] / 2
        u = (edges[:-1, None] + half) + half * _GL_NODES[None, :]  # [panels, nodes]
        x = np.exp(u)
        total += float(np.sum(half * _GL_WEIGHTS[None, :] * g(x.ravel()).reshape(x.shape) * x))
    return total


@dataclasses.dataclass(frozen=True)
class SimulationInput:
    """One table under one sharding config and load. ``qps`` requests per second,
    each looking up ``ids_per_request`` ids of this table; the lookup client
    deduplicates per window of ``window_ms`` (at least one request per window)."""

    rows: int
    dim: int
    zipf: float
    qps: float
    ids_per_request: int
    sharding: ShardingConfig
    window_ms: float = 0.0
    dtype: str = "float32"
    table: str = "item"
    row_cache_bytes: int = 0

    def __post_init__(self) -> None:
        checks = [
            (self.rows >= 1, "rows", self.rows, "use at least 1 row"),
            (self.dim >= 1, "dim", self.dim, "use a positive width"),
            (math.isfinite(self.zipf) and self.zipf >= 0, "zipf", self.zipf, "use a finite exponent >= 0"),
            (math.isfinite(self.qps) and self.qps > 0, "qps", self.qps, "use a positive request rate"),
            (self.ids_per_request >= 1, "ids_per_request", self.ids_per_request, "use at least 1 id per request"),
            (math.isfinite(self.window_ms) and self.window_ms >= 0, "window_ms", self.window_ms, "use 0 (one request per window) or a positive window"),
            (self.row_cache_bytes >= 0, "row_cache_bytes", self.row_cache_bytes, "use a byte count >= 0"),
        ]
        for ok, name, value, hint in checks:
            if not ok:
                raise ConfigError(f"plan simulate: {name} = {value!r} is invalid: {hint}")
        try:
            slice_row_bytes(1, self.dtype)
        except KeyError:
            raise ConfigError(f"plan simulate: dtype = {self.dtype!r} is invalid: use float32, float16 or int8") from None

    @property
    def requests_per_window(self) -> float:
        return max(1.0, self.qps * self.window_ms / 1000.0)

    @property
    def window_lookups(self) -> int:
        return max(1, int(round(self.requests_per_window * self.ids_per_request)))

    @property
    def windows_per_s(self) -> float:
        return self.qps / self.requests_per_window


def _std_normal_cdf(z: np.ndarray) -> np.ndarray:
    """Φ(z) by Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7), vectorised, no scipy."""
    x = np.abs(z) / math.sqrt(2.0)
    t = 1.0 / (1.0 + 0.3275911 * x)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    erf = 1.0 - poly * np.exp(-x * x)
    return 0.5 * (1.0 + np.sign(z) * erf)


def expected_max(means: np.ndarray, sigmas: np.ndarray, points: int = 4001) -> float:
    """E[max_s X_s] for independent ``X_s ~ N(means[s], sigmas[s]**2)`` (float64 [S]):
    ``hi - ∫ Π_s Φ((x - μ_s) / σ_s) dx`` on a grid spanning every shard's ±9σ."""
    sig = np.maximum(sigmas, 0.0)
    if not (sig > 0).any():
        return float(means.max())
    lo = float((means - 9 * sig).min())
    hi = float((means + 9 * sig).max())
    x = np.linspace(lo, hi, points)
    safe = np.where(sig > 0, sig, 1.0)
    z = (x[:, None] - means[None, :]) / safe[None, :]  # [points, S]
    cdf = np.where(sig[None, :] > 0, _std_normal_cdf(z), (x[:, None] >= means[None, :]).astype(np.float64))
    log_f = np.sum(np.log(np.maximum(cdf, 1e-300)), axis=1)
    f = np.exp(log_f)
    return hi - float(np.sum((f[1:] + f[:-1]) / 2 * np.diff(x)))


RING_SHARES_MAX_TOKENS = 1 << 15  # exact ring shares up to 512 shards x 64 vnodes (~3 s)


def ring_shares(num_shards: int, virtual_nodes: int, seed: int = 0) -> np.ndarray:
    """float64 [S]: each slot's share of the hash ring of the balanced plan ring
    (:func:`~recserve.sharding.ring.balanced_tokens`, what the planner builds), or
    exactly ``1/S`` beyond ``RING_SHARES_MAX_TOKENS`` tokens, where building the ring
    costs more than the figure is worth (shares stay within ``1/virtual_nodes`` of fair).
    Memory: the tokens only (``S * V * 8`` bytes)."""
    if num_shards * virtual_nodes > RING_SHARES_MAX_TOKENS:
        return np.full(num_shards, 1.0 / num_shards)
    ring = Ring(balanced_tokens(num_shards, virtual_nodes, seed))
    st = ring.sorted_tokens
    if st.size == 1:
        return np.ones(1)
    arcs = np.empty(st.size, dtype=np.uint64)
    arcs[1:] = st[1:] - st[:-1]
    arcs[:1] = st[:1] - st[-1:]  # wraps modulo 2**64: the arc past the top of the ring
    shares = np.bincount(ring.owners[: st.size], weights=arcs.astype(np.float64), minlength=num_shards)
    return shares / shares.sum()


def simulate(inp: SimulationInput, *, head_ranks: int = HEAD_RANKS, seed: int = 0) -> dict[str, Any]:
    """The capacity report of ``inp`` (JSON-ready dict; see the module docstring).
    ``seed``: the plan seed whose balanced ring shares weight each shard's load."""
    cfg = inp.sharding
    s, rows = cfg.num_shards, inp.rows
    n_hot = min(int(round(cfg.hot_fraction * rows)), rows)
    n_warm = min(int(round(cfg.warm_fraction * rows)), rows - n_hot)
    c = resolve_column_splits(inp.dim, cfg)
    r_hot, r_cold = cfg.hot_replicas, cfg.cold_replicas
    a, big_l = inp.zipf, inp.window_lookups
    norm = rank_sum(lambda x: np.exp(-a * np.log(x)), 1, rows, head_ranks)

    def p(x: np.ndarray) -> np.ndarray:
        return np.exp(-a * np.log(x)) / norm

    def q(x: np.ndarray) -> np.ndarray:
        return -np.expm1(big_l * np.log1p(-np.minimum(p(x), 1.0 - 1e-16)))

    tiers = {"hot": (1, n_hot), "warm": (n_hot + 1, n_hot + n_warm), "cold": (n_hot + n_warm + 1, rows)}
    share = {k: rank_sum(p, lo, hi, head_ranks) for k, (lo, hi) in tiers.items()}
    uniq = {k: rank_sum(q, lo, hi, head_ranks) for k, (lo, hi) in tiers.items()}
    sq = {k: rank_sum(lambda x: q(x) ** 2, lo, hi, head_ranks) for k, (lo, hi) in tiers.items()}
    sq_p = {k: rank_sum(lambda x: p(x) ** 2, lo, hi, head_ranks) for k, (lo, hi) in tiers.items()}

    rows_per_shard = {"hot": uniq["hot"] / s, "warm": c * uniq["warm"] / s, "cold": uniq["cold"] / s}
    mean = sum(rows_per_shard.values())
    # Per shard: the chance an id of each tier is placed there (owner share for cold;
    # owner shares of the slots it follows for hot replicas / warm slices).
    own = ring_shares(s, cfg.virtual_nodes, seed)
    pi_hot = sum(np.roll(own, r) for r in range(r_hot))
    pi_warm = sum(np.roll(own, k) for k in range(c))
    loads = uniq["cold"] * own + uniq["hot"] / r_hot * pi_hot + uniq["warm"] * pi_warm  # [S]
    var = sq["cold"] * own * (1 - own) + sq["hot"] / r_hot**2 * pi_hot * (1 - pi_hot) + sq["warm"] * pi_warm * (1 - pi_warm)
    # The shards' loads sum to a constant: deviations D = Y - mean(Y) of independent Y
    # with variance var * S / (S - 1), and max(mu + D) = max(mu + Y) - mean(Y).
    sigma = np.sqrt(np.maximum(var, 0.0) * (s / (s - 1) if s > 1 else 0.0))
    imbalance = expected_max(loads, sigma) / mean if mean > 0 else 1.0
    # RPCs: shard s gets none in a window when all L draws miss it. A draw lands on s
    # with probability X_s (its owner / slice / chosen replica is s), random over hash
    # placement with mean mu_s and variance v_s; E[(1 - X)^L] to second order.
    mu = share["cold"] * own + share["warm"] * pi_warm + share["hot"] / r_hot * pi_hot
    v = sq_p["cold"] * own * (1 - own) + sq_p["warm"] * pi_warm * (1 - pi_warm) + sq_p["hot"] / r_hot**2 * pi_hot * (1 - pi_hot)
    miss = np.clip(1.0 - mu, 1e-300, 1.0)
    none = np.exp(big_l * np.log(miss)) + 0.5 * big_l * (big_l - 1) * np.exp((big_l - 2) * np.log(miss)) * v
    p_rpc = float(np.mean(np.clip(1.0 - none, 0.0, 1.0)))
    wps = inp.windows_per_s

    # Bytes per shard (expected means over shards), the estimates.py model.
    row = slice_row_bytes(inp.dim, inp.dtype)
    base, extra = divmod(inp.dim, c)
    slice_bytes = [slice_row_bytes(base + (1 if k < extra else 0), inp.dtype) for k in range(c)]
    n_cold = rows - n_hot - n_warm
    hot_rows, warm_slices, cold_rows = n_hot * r_hot / s, n_warm * c / s, n_cold * r_cold / s
    hot_b = hot_rows * (row + DRAM_INDEX_BYTES_PER_ROW)
    warm_b = n_warm / s * sum(b + DRAM_INDEX_BYTES_PER_ROW for b in slice_bytes)
    rocks_row = row + ROCKSDB_OVERHEAD_BYTES_PER_ROW
    cold_b = cold_rows * rocks_row
    bytes_per_shard = {
        "hot": hot_b,
        "warm": warm_b,
        "cold": cold_b,
        "dram": hot_b + warm_b,
        "rocksdb": cold_b + hot_rows * rocks_row + n_warm / s * sum(b + ROCKSDB_OVERHEAD_BYTES_PER_ROW for b in slice_bytes),
        "row_cache": float(inp.row_cache_bytes),
    }
    # Network per shard and second: ids out, rows back.
    reply_per_window = rows_per_shard["hot"] * row + rows_per_shard["cold"] * row + uniq["warm"] / s * sum(slice_bytes)
    reply_per_window += mean * REPLY_MASK_BYTES_PER_ROW
    request_per_window = mean * 8
    rpcs_per_s = wps * p_rpc
    network = {
        "request_bytes_per_s": wps * request_per_window + rpcs_per_s * RPC_OVERHEAD_BYTES / 2,
        "reply_bytes_per_s": wps * reply_per_window + rpcs_per_s * RPC_OVERHEAD_BYTES / 2,
    }
    network["total_bytes_per_s"] = network["request_bytes_per_s"] + network["reply_bytes_per_s"]
    remap = {"cold": 1.0 / (s + 1), "hot": min(1.0, r_hot / (s + 1)), "warm": min(1.0, c / (s + 1))}
    owned_rows = hot_rows + warm_slices + cold_rows
    routing = routing_memory_bytes(
        rows=rows, hot_ids=n_hot, warm_ids=n_warm, num_shards=s, virtual_nodes=cfg.virtual_nodes,
        hot_replicas=r_hot, column_splits=c, cold_replicas=r_cold, dense_max_rows=cfg.dense_route_max_rows,
    )  # fmt: skip
    return {
        "inputs": {
            "table": inp.table, "rows": rows, "dim": inp.dim, "dtype": inp.dtype, "zipf": a, "shards": s,
            "qps": inp.qps, "ids_per_request": inp.ids_per_request, "window_ms": inp.window_ms,
            "requests_per_window": inp.requests_per_window, "window_lookups": big_l, "windows_per_s": wps,
            "hot_ids": n_hot, "warm_ids": n_warm, "cold_ids": n_cold,
            "hot_replicas": r_hot, "column_splits": c, "cold_replicas": r_cold, "virtual_nodes": cfg.virtual_nodes,
        },  # fmt: skip
        "traffic_share": share,
        "unique_ids_per_window": sum(uniq.values()),
        "unique_ids_per_window_by_tier": uniq,
        "unique_rows_per_shard_per_window": mean,
        "unique_rows_per_shard_per_window_by_tier": rows_per_shard,
        "unique_rows_per_shard_per_s": mean * wps,
        "lookups_per_window": big_l,
        "rpc_probability_per_shard_per_window": p_rpc,
        "rpcs_per_s_per_shard": rpcs_per_s,
        "imbalance": imbalance,
        "imbalance_sigma_over_mean": float(np.sqrt(np.maximum(var, 0.0)).mean()) / mean if mean > 0 else 0.0,
        "ring_share_max_over_mean": float(own.max() * s),
        "bytes_per_shard": bytes_per_shard,
        "remap_fraction_add_shard": remap,
        "remap_bytes_per_shard_add_shard": {
            # The newcomer receives 1/(S+1) of the rows; each old shard sends its part.
            "cold": remap["cold"] * cold_b, "hot": remap["hot"] * hot_b, "warm": remap["warm"] * warm_b,
        },  # fmt: skip
        "network_per_shard": network,
        "routing_memory_bytes": routing,
        "routing_memory_bytes_dense_map": rows * (2 if 3 * (s * cfg.virtual_nodes + 1) <= (1 << 16) else 4),
        "shard_index_bytes_per_shard": index_bytes(hot_rows + warm_slices, cold_rows),
        "landed_per_row_bytes": {
            # What the routing before the scale limit kept per row of the whole table.
            "shard_index_per_shard": LANDED_SHARD_INDEX_BYTES_PER_TABLE_ROW * rows,
            "router_tier_map": (rows + 3) // 4 if rows > DENSE_MAP_MAX_ROWS else rows * 2,
        },
        "owned_rows_per_shard": owned_rows,
    }


def index_bytes(dram_rows: float, cold_rows: float) -> dict[str, float]:
    """A shard's per-table index (closed form of ``embedding_server.table.TableTiers
    .index_bytes``) for ``dram_rows`` hot rows + warm slice-rows and ``cold_rows`` owned
    cold rows: 13 B per owned (slice-)row, + 4 B per cold row for the row cache's map."""
    owned = dram_rows + cold_rows
    return {
        "id_index": owned * SHARD_INDEX_BYTES_PER_OWNED_ROW,
        "row_cache_index": cold_rows * SHARD_CACHE_INDEX_BYTES_PER_COLD_ROW,
        "total": owned * SHARD_INDEX_BYTES_PER_OWNED_ROW + cold_rows * SHARD_CACHE_INDEX_BYTES_PER_COLD_ROW,
    }


def format_report(r: dict[str, Any]) -> str:
    """The human table of ``recserve plan simulate``."""
    i = r["inputs"]
    mb = float(1 << 20)
    gb = float(1 << 30)
    b = r["bytes_per_shard"]
    n = r["network_per_shard"]
    rm = r["remap_fraction_add_shard"]
    routing = r["routing_memory_bytes"]
    kind = "dense map" if "dense_codes" in routing else "ring + hot/warm sets"
    lines = [
        f"capacity simulation: table {i['table']!r} {i['rows']:,} x {i['dim']} {i['dtype']}, Zipf {i['zipf']}, {i['shards']} shards, "
        f"{i['qps']:,.0f} req/s x {i['ids_per_request']:,} ids ({i['window_lookups']:,} lookups per window, {i['windows_per_s']:,.1f} windows/s)",
        f"tiers: hot {i['hot_ids']:,} x{i['hot_replicas']} | warm {i['warm_ids']:,} in {i['column_splits']} slices | cold {i['cold_ids']:,} x{i['cold_replicas']}",
        f"traffic share: hot {r['traffic_share']['hot']:.3f}  warm {r['traffic_share']['warm']:.3f}  cold {r['traffic_share']['cold']:.3f}",
        f"unique ids per window: {r['unique_ids_per_window']:,.1f}   per shard: {r['unique_rows_per_shard_per_window']:,.1f} (slice-)rows "
        f"= {r['unique_rows_per_shard_per_s']:,.0f}/s",
        f"RPCs per shard: {r['rpcs_per_s_per_shard']:,.1f}/s (P[shard in a window] = {r['rpc_probability_per_shard_per_window']:.4f})   "
        f"imbalance (expected max/mean): {r['imbalance']:.3f}",
        f"bytes per shard: hot {b['hot'] / gb:,.3f} GiB  warm {b['warm'] / gb:,.3f} GiB  DRAM {b['dram'] / gb:,.3f} GiB  "
        f"cold {b['cold'] / gb:,.3f} GiB  RocksDB {b['rocksdb'] / gb:,.3f} GiB",
        f"network per shard: {n['request_bytes_per_s'] / mb:,.2f} MiB/s in, {n['reply_bytes_per_s'] / mb:,.2f} MiB/s out",
        f"remap on +1 shard: cold {rm['cold']:.4f}  hot {rm['hot']:.4f}  warm {rm['warm']:.4f} of each tier's ids",
        f"routing structures ({kind}): {routing['total'] / mb:,.1f} MiB per process"
        + (f", of which {routing['tier_sets'] / mb:,.1f} MiB are the plan's own hot/warm id arrays (not copied)" if "tier_sets" in routing else "")
        + f"; a dense map would be {r['routing_memory_bytes_dense_map'] / mb:,.1f} MiB",
        f"shard index: {r['shard_index_bytes_per_shard']['total'] / mb:,.1f} MiB per shard for {r['owned_rows_per_shard']:,.0f} owned rows "
        f"(was {r['landed_per_row_bytes']['shard_index_per_shard'] / mb:,.1f} MiB at 9 B per table row)",
    ]
    return "\n".join(lines)
