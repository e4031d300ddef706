"""In-process fake shard fleet for the lookup client's unit tests, plus factories.

:class:`FakeShards` answers the EmbeddingShard contract (protos/recserve/v1/embedding.proto)
from per-shard copies of source weight arrays, honouring the plan: a shard answers only
ids it owns (others flagged ``not_owned``), warm ids only for the slice it holds. State
is set explicitly: ``set_down``, ``set_error``, ``set_blocked`` / ``release``,
``set_plan``, ``set_missing``, ``set_max_ids``. It records every request so tests can count RPCs per
shard and see which ids went where. The tests at the bottom check the fake itself
against the plan, so the client's tests stand on a fake that honours the contract.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Coroutine, Sequence
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from recserve.config.spec import FeatureConfig, LookupConfig, ShardingConfig, TableConfig
from recserve.lookup.config import LookupClientConfig
from recserve.errors import InvalidArgument, Unavailable
from recserve.lookup.transport import shard_call_error
from recserve.rpc.tensors import pack, unpack
from recserve.sharding.plan import ShardingPlan, Tier
from recserve.sharding.planner import plan_tables
from recserve.v1 import common_pb2, embedding_pb2


@dataclasses.dataclass
class Recorded:
    shard: int
    request: embedding_pb2.LookupRequest

    def ids(self, table: str) -> np.ndarray:
        parts = [unpack(t.ids, "ids") for t in self.request.tables if t.table == table]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    @property
    def n_ids(self) -> int:
        """Ids in the request, over all its tables."""
        return sum(len(t.ids.data) // 8 for t in self.request.tables)


class FakeShards:
    """A fake fleet over ``weights`` (table -> fp32 [rows, dim]) under ``plan``."""

    def __init__(self, plan: ShardingPlan, weights: dict[str, np.ndarray]) -> None:
        self.plan = plan
        self.weights = weights
        self.store = [{t: w.copy() for t, w in weights.items()} for _ in range(plan.num_shards)]
        self.stored = [{t: np.ones(w.shape[0], bool) for t, w in weights.items()} for _ in range(plan.num_shards)]
        self.down = np.zeros(plan.num_shards, bool)
        self.errors: dict[int, grpc.StatusCode] = {}
        self.gates: dict[int, asyncio.Event] = {}
        self.calls: list[Recorded] = []
        self.upserts: list[tuple[int, embedding_pb2.UpsertRequest]] = []
        self.upsert_metadata: list[tuple[tuple[str, str], ...]] = []  # each upsert's call metadata (the admin token)
        self.plan_gets = 0
        self.closed = False
        self.max_ids: int | None = None

    # ---- explicit state setters ----------------------------------------------------
    def set_down(self, shard: int, down: bool = True) -> None:
        self.down[shard] = down

    def set_error(self, shard: int, code: grpc.StatusCode | None) -> None:
        if code is None:
            self.errors.pop(shard, None)
        else:
            self.errors[shard] = code

    def set_blocked(self, shard: int) -> None:
        """Hold this shard's lookup replies until :meth:`release` (or cancellation)."""
        self.gates[shard] = asyncio.Event()

    def release(self, shard: int) -> None:
        gate = self.gates.pop(shard, None)
        if gate is not None:
            gate.set()

    def set_plan(self, plan: ShardingPlan) -> None:
        """The plan the shards now serve (and report in replies / GetPlan)."""
        self.plan = plan

    def set_max_ids(self, n: int | None) -> None:
        """Answer RESOURCE_EXHAUSTED to lookups of more than ``n`` ids, as a real shard
        does above its ``max_ids_per_rpc`` (None: no limit)."""
        self.max_ids = n

    def set_missing(self, table: str, ids: np.ndarray) -> None:
        """These ids are not stored anywhere (answered with the default row, found=0)."""
        for s in range(len(self.stored)):
            self.stored[s][table][ids] = False

    # ---- counters ------------------------------------------------------------------------
    def rpcs(self, shard: int | None = None) -> int:
        return sum(1 for c in self.calls if shard is None or c.shard == shard)

    def reset_calls(self) -> None:
        self.calls.clear()

    # ---- the transport -----------------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        return self.plan.num_shards

    def _check(self, shard: int) -> None:
        if self.down[shard]:
            raise shard_call_error(shard, grpc.StatusCode.UNAVAILABLE, "connection refused (fake)")
        code = self.errors.get(shard)
        if code is not None:
            raise shard_call_error(shard, code, "injected (fake)")

    def start_lookup(self, shard: int, request: embedding_pb2.LookupRequest, timeout_s: float) -> Coroutine[Any, Any, embedding_pb2.LookupResponse]:
        return self.lookup(shard, request, timeout_s)

    async def lookup(self, shard: int, request: embedding_pb2.LookupRequest, timeout_s: float) -> embedding_pb2.LookupResponse:
        self.calls.append(Recorded(shard, request))
        self._check(shard)
        n_ids = self.calls[-1].n_ids
        if self.max_ids is not None and n_ids > self.max_ids:
            raise shard_call_error(shard, grpc.StatusCode.RESOURCE_EXHAUSTED, f"LookupRequest carries {n_ids:,} ids; max_ids_per_rpc = {self.max_ids:,} (fake)")
        gate = self.gates.get(shard)
        if gate is not None:
            try:
                await asyncio.wait_for(gate.wait(), timeout_s)
            except asyncio.TimeoutError:
                raise shard_call_error(shard, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline (fake)") from None
        out = []
        for t in request.tables:
            plan = self.plan.table(t.table)
            ids = unpack(t.ids, "ids", expect_dtype=common_pb2.INT64)
            k = plan.slice_of(t.col_start, t.col_end)
            a, b = (0, plan.dim) if (t.col_start, t.col_end) == (0, 0) else (t.col_start, t.col_end)
            owned = self.plan.router(t.table).owns(shard, ids, k)
            found = owned & np.take(self.stored[shard][t.table], ids)
            rows = np.take(self.store[shard][t.table][:, a:b], ids, axis=0)
            rows[~found] = 0.0
            tr = embedding_pb2.TableRows(table=t.table, found=pack(found.astype(np.uint8)), not_owned=pack((~owned).astype(np.uint8)), col_start=a, col_end=b)
            if request.pooled:
                idx = unpack(t.bag_indices, "bag_indices")
                off = unpack(t.bag_offsets, "bag_offsets")
                contrib = np.where(owned[:, None], rows, 0.0).astype(np.float32)
                per = np.take(contrib, idx, axis=0)
                sums = np.zeros((off.shape[0] - 1, b - a), np.float32)
                counts = np.zeros(off.shape[0] - 1, np.int64)
                nonempty = np.flatnonzero(np.diff(off) > 0)
                if nonempty.size:
                    sums[nonempty] = np.add.reduceat(per, off[:-1][nonempty], axis=0)
                    counts[nonempty] = np.add.reduceat(np.take(owned, idx).astype(np.int64), off[:-1][nonempty])
                tr.pooled.CopyFrom(pack(sums))
                tr.bag_counts.CopyFrom(pack(counts))
            elif request.row_dtype == common_pb2.FLOAT16:
                tr.rows.CopyFrom(pack(rows.astype(np.float16)))
            elif request.row_dtype == common_pb2.INT8_ROWWISE:
                import fbgemm_gpu  # noqa: F401

                fused = torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(torch.from_numpy(np.ascontiguousarray(rows))).numpy()
                tr.rows.CopyFrom(pack(fused, common_pb2.INT8_ROWWISE))
            else:
                tr.rows.CopyFrom(pack(rows))
            out.append(tr)
        return embedding_pb2.LookupResponse(plan_version=self.plan.version, tables=out)

    async def upsert(self, shard: int, request: embedding_pb2.UpsertRequest, timeout_s: float,
                     metadata: Sequence[tuple[str, str]] = ()) -> embedding_pb2.UpsertResponse:  # fmt: skip
        self.upserts.append((shard, request))
        self.upsert_metadata.append(tuple(metadata))
        self._check(shard)
        written = 0
        for t in request.tables:
            plan = self.plan.table(t.table)
            ids = unpack(t.ids, "ids")
            rows = unpack(t.rows, "rows")
            k = plan.slice_of(t.col_start, t.col_end)
            owned = self.plan.router(t.table).owns(shard, ids, k)
            if not owned.all():
                raise shard_call_error(shard, grpc.StatusCode.FAILED_PRECONDITION, f"ids {ids[~owned].tolist()} not owned")
            a, b = (0, plan.dim) if (t.col_start, t.col_end) == (0, 0) else (t.col_start, t.col_end)
            self.store[shard][t.table][ids, a:b] = rows
            self.stored[shard][t.table][ids] = True
            written += ids.shape[0]
        return embedding_pb2.UpsertResponse(rows_written=written, plan_version=self.plan.version)

    async def get_plan(self, shard: int, timeout_s: float) -> embedding_pb2.GetPlanResponse:
        self.plan_gets += 1
        self._check(shard)
        return embedding_pb2.GetPlanResponse(plan_version=self.plan.version, plan_json=self.plan.to_json())

    async def shard_info(self, shard: int, timeout_s: float) -> embedding_pb2.ShardInfoResponse:
        self._check(shard)
        return embedding_pb2.ShardInfoResponse(shard_id=shard, plan_version=self.plan.version, rpcs=self.rpcs(shard))

    async def close(self) -> None:
        self.closed = True


# ---- factories -------------------------------------------------------------------------------

TABLES = (
    TableConfig("item", rows=2000, dim=16, pooling="sum"),
    TableConfig("wide", rows=600, dim=24, pooling="sum"),
    TableConfig("user", rows=500, dim=8, pooling="mean"),
)
# item is read by two features (shared table); wide is column-split 2 ways.
FEATURES = (
    FeatureConfig("item_id", "item"),
    FeatureConfig("hist_items", "item"),
    FeatureConfig("wide_tag", "wide"),
    FeatureConfig("user_id", "user"),
)


def zipf_freq(rows: int, a: float, rng: np.random.Generator) -> np.ndarray:
    """Zipf(a) frequencies over a random permutation of ids (popularity not id order)."""
    f = 1.0 / np.arange(1, rows + 1, dtype=np.float64) ** a
    return f[rng.permutation(rows)]


def make_plan(tables: Sequence[TableConfig] = TABLES, *, num_shards: int = 3, seed: int = 0, version: int = 1, **sharding: object) -> tuple[ShardingPlan, dict[str, np.ndarray]]:
    """A plan with hot / warm / cold tiers over Zipf frequencies; the wide table gets 2
    column slices. Returns (plan, frequencies per table)."""
    rng = np.random.default_rng(seed)
    freq = {t.name: zipf_freq(t.rows, 1.05, rng) for t in tables}
    params: dict[str, object] = dict(num_shards=num_shards, hot_fraction=0.05, warm_fraction=0.2, hot_replicas=2)
    params.update(sharding)
    cfg = ShardingConfig(**params)  # type: ignore[arg-type]
    plan = plan_tables(list(tables), freq, cfg, version=version, seed=seed).plan
    if "column_splits" not in sharding and "wide" in plan.tables:
        wide = plan.tables["wide"]
        tables_d = dict(plan.tables)
        tables_d["wide"] = dataclasses.replace(wide, column_splits=2)
        plan = ShardingPlan(version=plan.version, num_shards=plan.num_shards, tables=tables_d, virtual_nodes=plan.virtual_nodes, seed=plan.seed)
    return plan, freq


def make_weights(tables: Sequence[TableConfig] = TABLES, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {t.name: rng.standard_normal((t.rows, t.dim)).astype(np.float32) for t in tables}


def make_config(**overrides: object) -> LookupClientConfig:
    lookup = overrides.pop("lookup", LookupConfig())
    return LookupClientConfig(tables=TABLES, features=FEATURES, lookup=lookup, **overrides)  # type: ignore[arg-type]


def tier_ids(plan: ShardingPlan, table: str, tier: Tier) -> np.ndarray:
    t = plan.table(table)
    if tier is Tier.HOT:
        return t.hot_ids
    if tier is Tier.WARM:
        return t.warm_ids
    return np.setdiff1d(np.arange(t.rows), np.concatenate((t.hot_ids, t.warm_ids)))


# ---- the fake's own contract tests -----------------------------------------------------------


def _lookup_req(table: str, ids: np.ndarray, col: tuple[int, int] = (0, 0)) -> embedding_pb2.LookupRequest:
    return embedding_pb2.LookupRequest(tables=[embedding_pb2.TableLookup(table=table, ids=pack(ids), col_start=col[0], col_end=col[1])])


def test_fake_answers_owned_rows_and_flags_the_rest() -> None:
    plan, _ = make_plan()
    weights = make_weights()
    fake = FakeShards(plan, weights)
    cold = tier_ids(plan, "item", Tier.COLD)[:50]
    owner = plan.router("item").cold_owners_of(cold)[:, 0]
    shard = int(owner[0])
    reply = asyncio.run(fake.lookup(shard, _lookup_req("item", cold), 1.0))
    tr = reply.tables[0]
    not_owned = unpack(tr.not_owned, "n").astype(bool)
    np.testing.assert_array_equal(not_owned, owner != shard)
    rows = unpack(tr.rows, "r")
    np.testing.assert_array_equal(rows[~not_owned], weights["item"][cold[~not_owned]])
    assert (rows[not_owned] == 0).all()


def test_fake_serves_warm_slices_only_where_held() -> None:
    plan, _ = make_plan()
    weights = make_weights()
    fake = FakeShards(plan, weights)
    warm = tier_ids(plan, "wide", Tier.WARM)[:20]
    slice_shards = plan.router("wide").warm_shards_of(warm)
    a, b = plan.table("wide").col_bounds()[1]
    shard = int(slice_shards[0, 1])
    reply = asyncio.run(fake.lookup(shard, _lookup_req("wide", warm, (a, b)), 1.0))
    not_owned = unpack(reply.tables[0].not_owned, "n").astype(bool)
    np.testing.assert_array_equal(not_owned, slice_shards[:, 1] != shard)
    rows = unpack(reply.tables[0].rows, "r")
    np.testing.assert_array_equal(rows[~not_owned], weights["wide"][warm[~not_owned], a:b])


def test_fake_state_setters_fail_calls() -> None:
    plan, _ = make_plan()
    fake = FakeShards(plan, make_weights())
    fake.set_down(1)
    with pytest.raises(Unavailable, match="shard 1: UNAVAILABLE"):
        asyncio.run(fake.lookup(1, _lookup_req("item", np.array([1])), 1.0))
    fake.set_down(1, False)
    fake.set_error(1, grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(InvalidArgument, match="shard 1: INVALID_ARGUMENT"):
        asyncio.run(fake.lookup(1, _lookup_req("item", np.array([1])), 1.0))
