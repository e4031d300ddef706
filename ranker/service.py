"""The Ranking service's core: batched Rank and EmbedUser over remote embeddings
(docs/architecture.md §7).

Concurrent requests queue on one :class:`~recserve.scheduling.ServingLoop` per model,
driven by a :class:`~recserve.scheduling.DynamicBatchPolicy` whose cost is the candidate
count (adaptive window, SLO controller). A batch runs as:

1. :func:`ranker.batch.layout`: the batch's pairs and per-request histories (arrays);
2. **one** ``LookupClient.lookup`` for all of the batch's pooled features (L3 adds its
   unpooled history rows as a second caller of the same window), so ids are
   deduplicated across the batch's requests (and across concurrent batches' windows);
3. the forward on the executor thread, never on the event loop: DLRM's
   ``score_pooled``, L3's ``score_looked_up``, or the two-tower user tower (plus inner
   products with the exported item vectors for Rank).

Rows a lookup could not fetch in time come back as default rows (zeros); the requests
they belong to (per-bag counts, :attr:`LookupResult.missing_bags`) answer ``degraded``
with ``lookup_missing`` and their ``missing_rows``. A user beyond the exported users is
a new user: no id row, no exported history, zero log counts, the request's
``history_item_ids`` only (``cold_start``).

Model versions: everything a version needs is one :class:`ModelSet` (export, modules,
its own lookup client and the names its tables are served under). :meth:`RankingCore.reload`
opens another beside it, switches with one assignment on the event loop, and closes the
old one once the batches that pinned it have finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ranker import batch as B
from ranker.batch import Query, QueryKind
from ranker.features import LogCounts, ServingArrays, Source, SparseFeature, dense_features, item_dense_features, user_dense_features
from ranker.models.dlrm import DLRM_FEATURES, DlrmRanker
from ranker.models.common import mean_pool
from ranker.models.l3 import L3Reranker
from ranker.export import OFFLINE_TABLES
from ranker.models.two_tower import ITEM_TOWER_FEATURES, USER_TOWER_FEATURES, TwoTower
from ranker.rollout import feature_renames, served_table_names
from ranker.scoring import resolve_device
from ranker.serving import Export, Model, load_model, open_export
from recserve.config.spec import ClusterConfig, FeatureConfig, RankerConfig, TableConfig
from recserve.catalog.storage import Csr
from recserve.errors import FailedPrecondition, InternalError, InvalidArgument, ResourceExhausted
from recserve.lookup.client import LookupClient
from recserve.lookup.config import LookupClientConfig
from recserve.lookup.types import LookupResult
from recserve.scheduling import Batch, Done, DynamicBatchConfig, DynamicBatchPolicy, Failed, Scheduler, SchedulerView, ServingLoop
from recserve.scheduling.device import LaneExecutor
from recserve.sharding.plan import ShardingPlan

log = logging.getLogger(__name__)

MAX_HISTORY_ITEMS = 1024  # history_item_ids per request
PROBE_CANDIDATES = 8  # items the deep check ranks
COLD_START = "cold_start"
LOOKUP_MISSING = "lookup_missing"


@dataclasses.dataclass(frozen=True)
class Answer:
    """One request's result. Rank: ``item_ids`` int64 [C] by score descending, ``scores``
    float32 [C]; EmbedUser: ``vector`` float32 [d]."""

    model: str
    model_version: str
    item_ids: np.ndarray
    scores: np.ndarray
    vector: np.ndarray | None
    missing_rows: int
    degraded_reasons: tuple[str, ...]

    @property
    def degraded(self) -> bool:
        return bool(self.degraded_reasons)


@dataclasses.dataclass(frozen=True)
class _Lookups:
    """One batch's lookup results: pooled features, L3's unpooled history rows, and per
    crossed feature its rows with the :class:`~ranker.batch.CrossBags` to pool them."""

    pooled: LookupResult
    rows: LookupResult | None
    crossed: dict[str, tuple[LookupResult, B.CrossBags]]


def model_features(model: Model) -> tuple[tuple[SparseFeature, ...], tuple[SparseFeature, ...]]:
    """(pooled, unpooled) remote features a model reads."""
    if isinstance(model, DlrmRanker):
        return DLRM_FEATURES, ()
    if isinstance(model, TwoTower):
        return USER_TOWER_FEATURES, ()
    return model.pooled_features, model.unpooled_features


class ModelSet:
    """One loaded ``model_version``: its export, modules, item vectors and lookup client.

    ``served`` maps each base table (``dlrm_item``) to the name the shards serve this
    version under (the same name, or a version-prefixed one during a rollout, see
    :mod:`ranker.rollout`); ``feature_names`` does the same for features.
    """

    def __init__(self, export: Export, models: dict[str, Model], client: LookupClient, served: Mapping[str, str], feature_names: Mapping[str, str]) -> None:
        self.export = export
        self.version = export.model_version
        self.models = models
        self.client = client
        self.served = dict(served)
        self.feature_names = dict(feature_names)
        self.inverse_names = {v: k for k, v in self.feature_names.items()}
        self.item_vectors = np.load(export.path / "index" / "item_vectors.npy", mmap_mode="r") if "two_tower" in models else None
        self.inflight = 0
        self.drained = asyncio.Event()
        self.drained.set()

    def pin(self) -> None:
        self.inflight += 1
        self.drained.clear()

    def unpin(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.drained.set()


async def open_model_set(cluster: ClusterConfig, models_dir: str | Path, shard_addresses: Sequence[str], *, plan: ShardingPlan,
                         reported: Mapping[str, str], expected_version: str = "") -> ModelSet:
    """Load MODELS for ``cluster.ranker.models`` and start a lookup client for the tables
    the shards serve its version under. ``reported``: table -> model_version from every
    shard's ShardInfo; ``plan``: the shards' current plan (GetPlan)."""
    rc = cluster.ranker
    export = await asyncio.to_thread(open_export, models_dir)
    if expected_version and export.model_version != expected_version:
        raise FailedPrecondition(f"model_version = {expected_version!r} was asked for, but {models_dir} holds model_version {export.model_version!r}")
    models = {name: await asyncio.to_thread(load_model, export, name, device=rc.device) for name in rc.models}
    pooled_all: list[SparseFeature] = []
    for m in models.values():
        pooled, unpooled = model_features(m)
        pooled_all += [f for f in pooled + unpooled if f not in pooled_all]
    if "two_tower" in models:  # the item tower's remote rows, for items added while serving
        pooled_all += [f for f in ITEM_TOWER_FEATURES if f.table not in OFFLINE_TABLES]
    base_tables = sorted({f.table for f in pooled_all})
    served = served_table_names(base_tables, export.model_version, reported)
    spec = export.manifest["tables"]
    tables = tuple(TableConfig(name=served[t], rows=int(spec[t]["rows"]), dim=int(spec[t]["dim"]), pooling=str(spec[t]["pooling"])) for t in base_tables)
    names = feature_renames(pooled_all, served)
    features = tuple(FeatureConfig(name=names[f.name], table=served[f.table]) for f in pooled_all)
    config = dataclasses.replace(LookupClientConfig.from_cluster(cluster), tables=tables, features=features)
    client = LookupClient.connect(config, plan, shard_addresses)
    await client.start()
    return ModelSet(export, models, client, served, names)


class IdleDispatchPolicy(DynamicBatchPolicy):
    """:class:`~recserve.scheduling.DynamicBatchPolicy` that does not hold a request
    while no batch is running: a batch dispatches at once when the ranker is idle, and
    the formation window (``max_wait_ms``, adaptive, SLO-scaled) applies only while a
    batch is in flight.

    Why: an idle ranker's window waits its whole cap for company that, below capacity,
    rarely comes (Poisson arrivals at 50/s meet another one within 2 ms 10% of the
    time), so every unloaded request paid the full ``max_wait_ms`` (2.6 ms of a 20 ms
    Rank measured, asyncio's timer granularity included). Under load the batches
    still form: requests that arrive while batches run queue behind them (at most
    ``max_inflight_batches`` run) and leave together, plus the window for a free slot.
    """

    def ready_at(self, view: SchedulerView, now: float) -> float | None:
        if view.queued_count and not view.inflight_batches:
            return now
        return super().ready_at(view, now)


class RankingCore:
    """Validates, batches and scores requests on the current :class:`ModelSet`.

    ``executor`` runs the forwards (default: a thread of its own). A ranker co-located
    with a decoder on one device gets the critical lane of the process's
    :class:`~recserve.scheduling.device.DeviceExecutor` here, so its batches go before
    decode steps — from the moment a batch starts its lookups (it is announced), not only
    once its forward is queued; the executor's owner shuts it down."""

    def __init__(self, config: RankerConfig, models: ModelSet, *, executor: Executor | None = None) -> None:
        self.config = config
        self.current = models
        self.reloads = 0
        if config.threads:
            torch.set_num_threads(config.threads)
        self.device = resolve_device(config.device)
        self._own_executor = executor is None
        self._executor = executor if executor is not None else ThreadPoolExecutor(1, thread_name_prefix="ranker-forward")
        self._loops: dict[str, ServingLoop] = {}
        self._adding = asyncio.Lock()
        self.forwards = 0  # batches run (each one forward)
        self._forward_s = 0.0  # EWMA of one forward's wall time (the lookups' margin before the deadline)
        self.requests = 0

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        rc = self.config
        for name in rc.models:
            if rc.batching:
                # The SLO controller may shrink batches, never below one whole request.
                dyn = DynamicBatchConfig(max_batch_cost=rc.max_batch_candidates, max_wait_ms=rc.max_wait_ms, slo_ms=rc.slo_ms, min_batch_cost=rc.max_candidates)
            else:  # one request per forward: every request costs the whole cap
                dyn = DynamicBatchConfig(max_batch_cost=1.0, max_wait_ms=0.0, adaptive=False)
            loop = ServingLoop(Scheduler(IdleDispatchPolicy(dyn)), self._run, rc.max_inflight_batches, name=f"rank-{name}")
            loop.start()
            self._loops[name] = loop

    async def aclose(self) -> None:
        for loop in self._loops.values():
            await loop.aclose()
        await self.current.client.aclose()
        if self._own_executor:
            self._executor.shutdown(wait=True)

    async def reload(self, new: ModelSet) -> ModelSet:
        """Serve ``new`` from now on; returns the old set once its pinned batches have
        finished and its lookup client is closed. Batches that started before the switch
        finish on the old set; every later batch (queued requests included) runs on the
        new one, so no request is dropped or fails for the switch."""
        old = self.current
        want, got = old.export.manifest["catalog"]["fingerprint"], new.export.manifest["catalog"]["fingerprint"]
        if want != got or set(new.models) != set(old.models):
            await new.client.aclose()
            raise FailedPrecondition(
                f"export {new.export.path} (model_version {new.version!r}) was trained on catalog {got!r} with models {sorted(new.models)}; "
                f"this ranker serves catalog {want!r} with {sorted(old.models)}: requests validated against one must not be scored by the other"
            )
        self.current = new  # one assignment on the event loop: the switch is atomic
        self.reloads += 1
        await old.drained.wait()
        await old.client.aclose()
        log.info("ranker switched from model_version %s to %s", old.version, new.version)
        return old

    async def add_items(self, ids: np.ndarray, categories: np.ndarray, tag_ids: np.ndarray, tag_lengths: np.ndarray) -> np.ndarray:
        """Learn new items (the next ids after the known ones, up to the export's reserved
        ``new_item_rows``): their categories and tags join the serving arrays, and with
        the two-tower served, their item-tower vectors ``[N, d]`` f32 are returned
        (computed on their shard rows: upsert those first, as the cascade's AddItems
        does). Requests validated from now on may name them."""
        async with self._adding:
            ms = self.current
            arrays = ms.export.arrays
            n0, n = arrays.num_items, int(ids.shape[0])
            capacity = int(ms.export.manifest["catalog"]["items"]) + int(ms.export.manifest.get("new_item_rows", 0))
            num_tags = int(ms.export.manifest["catalog"]["tags"])
            _check_new_items(ids, categories, tag_ids, tag_lengths, n0=n0, capacity=capacity, num_categories=arrays.num_categories, num_tags=num_tags)
            offsets = np.asarray(arrays.item_tags.offsets)
            c = arrays.counts
            grown = ServingArrays(
                item_category=np.concatenate((np.asarray(arrays.item_category), categories)),
                item_tags=Csr(np.concatenate((np.asarray(arrays.item_tags.values), tag_ids)), np.concatenate((offsets, offsets[-1] + np.cumsum(tag_lengths)))),
                user_history=arrays.user_history,
                counts=LogCounts(item=np.concatenate((np.asarray(c.item), np.zeros((n, 2), np.int64))), user=c.user, category=c.category, total=c.total),
            )  # fmt: skip
            vectors = np.zeros((n, 0), np.float32)
            tt = ms.models.get("two_tower")
            if isinstance(tt, TwoTower):
                feats = tuple(f for f in ITEM_TOWER_FEATURES if f.table not in OFFLINE_TABLES)
                lay = B.layout(grown, [Query(QueryKind.RANK, "two_tower", 0, True, ids, np.zeros(0, np.int64))])
                keys, values, lengths = B.pooled_features(lay, feats, ms.feature_names)
                result = await ms.client.lookup(_kjt(keys, values, lengths), pooled=True, timeout_s=self.config.default_timeout_ms / 1e3)
                loop = asyncio.get_running_loop()
                vectors = await loop.run_in_executor(self._executor, _item_tower, ms, tt, grown, ids, tag_ids, tag_lengths, result, self.device)
                ms.item_vectors = np.concatenate((np.asarray(ms.item_vectors), vectors))
            ms.export = dataclasses.replace(ms.export, arrays=grown)  # one assignment: batches read the arrays once
            log.info("ranker learned %d new items (%d..%d)", n, n0, n0 + n - 1)
            return vectors

    # ---- requests --------------------------------------------------------------------

    def query(self, kind: QueryKind, model: str, user_id: int, candidates: np.ndarray, history: np.ndarray) -> Query:
        """Validate one request (InvalidArgument naming the field and value)."""
        rc = self.config
        arrays = self.current.export.arrays
        model = model or ("two_tower" if kind is QueryKind.EMBED else rc.models[0])
        if model not in rc.models:
            raise InvalidArgument(f"model = {model!r} is invalid: this ranker serves {list(rc.models)}")
        if kind is QueryKind.EMBED and model != "two_tower":
            raise InvalidArgument(f"EmbedUser needs the two_tower model; this ranker serves {list(rc.models)}")
        if user_id < 0:
            raise InvalidArgument(f"user_id = {user_id} is invalid: use a user id >= 0 (ids beyond the {arrays.num_users:,} exported users are new users)")
        n = arrays.num_items
        if kind is QueryKind.RANK:
            if candidates.shape[0] == 0:
                raise InvalidArgument(f"candidate_ids is empty: give 1..{rc.max_candidates:,} item ids")
            if candidates.shape[0] > rc.max_candidates:
                raise InvalidArgument(f"candidate_ids has {candidates.shape[0]:,} ids: this ranker takes at most ranker.max_candidates = {rc.max_candidates:,} per request")
            _check_items("candidate_ids", candidates, n)
        if history.shape[0] > MAX_HISTORY_ITEMS:
            raise InvalidArgument(f"history_item_ids has {history.shape[0]:,} ids: give at most {MAX_HISTORY_ITEMS:,} recent items")
        _check_items("history_item_ids", history, n)
        return Query(kind=kind, model=model, user_id=user_id, cold=user_id >= arrays.num_users, candidates=candidates, history=history)

    async def submit(self, query: Query, *, deadline: float, tenant: str = "default", priority: str = "standard", request_id: str | None = None) -> Answer:
        cost = 1.0 if not self.config.batching else float(max(1, query.candidates.shape[0]))
        answer: Answer = await self._loops[query.model].submit(query, cost=cost, deadline=deadline, tenant=tenant, priority=priority, request_id=request_id)
        return answer

    async def deep_probe(self, timeout_s: float = 5.0) -> dict[str, Answer]:
        """The deep check (recserve.rpc.health): a fixed Rank of the first few items for
        user 0, per model, through the real scheduler, lookups and executor. It must
        answer every candidate once with finite scores. Returns the answers by model
        (a shed model is left out), which ranker/server.py compares with their first
        undegraded values (an Upsert of those rows or a reload rightly changes them)."""
        n = min(PROBE_CANDIDATES, self.current.export.arrays.num_items)
        candidates = np.arange(n, dtype=np.int64)
        answers: dict[str, Answer] = {}
        for model in self.config.models:
            query = self.query(QueryKind.RANK, model, 0, candidates, np.empty(0, np.int64))
            try:
                answer = await self.submit(query, deadline=time.monotonic() + timeout_s, tenant="recserve-deep-check", priority="critical")
            except ResourceExhausted:
                continue
            if answer.scores.shape != (n,) or not np.isfinite(answer.scores).all() or not np.array_equal(np.sort(answer.item_ids), candidates):
                raise InternalError(
                    f"model {model!r}: the fixed Rank of items 0..{n - 1} for user 0 answered ids {answer.item_ids.tolist()} "
                    f"with scores {answer.scores.tolist()}; expected each candidate once, finite scores"
                )
            answers[model] = answer
        return answers

    # ---- one batch -------------------------------------------------------------------

    async def _run(self, batch: Batch) -> list[Done | Failed]:
        ms = self.current  # pinned: a reload mid-batch does not change what this batch reads
        ms.pin()
        # On a shared device, decode yields to this batch from its lookups to its forward's end.
        held = self._executor.announced() if isinstance(self._executor, LaneExecutor) else contextlib.nullcontext()
        try:
            with held:
                queries: list[Query] = batch.payloads
                lay = B.layout(ms.export.arrays, queries)
                deadline = min(h.deadline for h in batch.handles)
                model = ms.models[queries[0].model]
                # The lookups stop waiting early enough to score and answer by the deadline.
                # When that point has already passed (the batch's tightest request is within
                # the margin of its deadline), they get half the time left (at least 1 ms): a lookup whose
                # deadline is past is refused, and that would fail every request of the batch
                # (the deep check's included, and with it readiness), not only the tight one.
                now = time.monotonic()
                lookup_by = deadline - self.config.reply_margin_ms / 1e3 - 2.0 * self._forward_s
                looked = await self._lookup(ms, model, lay, lookup_by if lookup_by > now else now + max((deadline - now) / 2, 0.001))
                loop = asyncio.get_running_loop()
                t0 = time.monotonic()
                answers = await loop.run_in_executor(self._executor, self._forward, ms, model, queries, lay, looked)
                took = time.monotonic() - t0
                self._forward_s = took if self.forwards == 0 else 0.9 * self._forward_s + 0.1 * took
            self.forwards += 1
            self.requests += len(answers)
            return [Done(a) for a in answers]
        finally:
            ms.unpin()

    async def _lookup(self, ms: ModelSet, model: Model, lay: B.BatchLayout, deadline: float) -> _Lookups:
        """The batch's lookups, all awaited together so they share one window: the pooled
        features, L3's unpooled history rows, and the crossed features' per-request ids."""
        pooled, unpooled = model_features(model)
        names = ms.feature_names
        crossed = tuple(f for f in pooled if f.source is Source.CATEGORY_CROSS)
        pooled = tuple(f for f in pooled if f.source is not Source.CATEGORY_CROSS)
        if isinstance(model, TwoTower):
            keys, values, lengths = B.request_features(lay, pooled, names)
        else:
            keys, values, lengths = B.pooled_features(lay, pooled, names)
        calls = [ms.client.lookup(_kjt(keys, values, lengths), pooled=True, deadline=deadline)]
        if unpooled:
            keys, values, lengths = B.request_features(lay, unpooled, names)
            calls.append(ms.client.lookup(_kjt(keys, values, lengths), pooled=False, deadline=deadline))
        bags = {f.name: B.cross_bags(lay, f) for f in crossed}
        for f in crossed:
            calls.append(ms.client.lookup(_kjt([names[f.name]], bags[f.name].ids, bags[f.name].id_lengths), pooled=False, deadline=deadline))
        results = list(await asyncio.gather(*calls))
        n = 1 + int(bool(unpooled))
        return _Lookups(pooled=results[0], rows=results[1] if unpooled else None, crossed={f.name: (results[n + i], bags[f.name]) for i, f in enumerate(crossed)})

    @torch.no_grad()
    def _forward(self, ms: ModelSet, model: Model, queries: list[Query], lay: B.BatchLayout, looked: _Lookups) -> list[Answer]:
        """Score the batch (executor thread). Returns one Answer per query."""
        dev = self.device
        inv = ms.inverse_names
        assert looked.pooled.pooled is not None
        pooled = {inv[k]: v.to(dev) for k, v in looked.pooled.pooled.to_dict().items()}
        vectors: torch.Tensor | None = None
        if isinstance(model, TwoTower):
            user_dense = torch.from_numpy(user_dense_features(lay.arrays, np.arange(lay.num_requests))).to(dev)
            vectors = model.user_from_pooled(pooled, user_dense)  # [R, d]
            missing = B.missing_per_request(lay, looked.pooled.missing_bags, per_pair=False)
            if lay.num_pairs:
                assert ms.item_vectors is not None
                items = torch.from_numpy(np.ascontiguousarray(ms.item_vectors[lay.pair_items])).to(dev)
                scores = (items * vectors[torch.from_numpy(lay.pair_request).to(dev)]).sum(dim=1)
            else:
                scores = torch.zeros(0)
        else:
            rows = torch.from_numpy(B.expand_user_side(lay)).to(dev)
            pooled_f, unpooled_f = model_features(model)
            for f in pooled_f:
                if f.source in B.USER_SIDE:
                    pooled[f.name] = pooled[f.name].index_select(0, rows)
            dense = torch.from_numpy(dense_features(lay.arrays, lay.pair_request, lay.pair_items)).to(dev)
            missing = B.missing_per_request(lay, looked.pooled.missing_bags, per_pair=True)
            for name, (result, bags) in looked.crossed.items():
                # The crossed bags' mean rows, pooled here: one weighted embedding_bag (B.CrossBags).
                rows_c = result.rows[ms.feature_names[name]].to(dev)
                offsets = torch.from_numpy(np.cumsum(bags.bag_lengths) - bags.bag_lengths).to(dev)
                pooled[name] = F.embedding_bag(torch.from_numpy(bags.index).to(dev), rows_c, offsets, mode="sum",
                                               per_sample_weights=torch.from_numpy(bags.weights).to(dev))  # fmt: skip
                missing += B.missing_per_request(lay, result.missing_bags, per_pair=False)
            if isinstance(model, DlrmRanker):
                scores = model.score_pooled(dense, pooled)
            else:
                assert isinstance(model, L3Reranker)
                flat = looked.rows
                assert flat is not None
                lengths = flat.lengths[names_of(ms, unpooled_f[0])].numpy()
                idx = torch.from_numpy(B.expand_rows(lengths, lay.pair_request)).to(dev)
                hist = {f.name: flat.rows[names_of(ms, f)].to(dev).index_select(0, idx) for f in unpooled_f}
                scores = model.score_looked_up(pooled, hist, torch.from_numpy(np.take(lengths, lay.pair_request)).to(dev), dense)
                missing += B.missing_per_request(lay, flat.missing_bags, per_pair=False)
        return _answers(ms, queries, lay, scores.float().cpu().numpy(), vectors, missing)


@torch.no_grad()
def _item_tower(ms: ModelSet, tt: TwoTower, arrays: ServingArrays, ids: np.ndarray, tag_ids: np.ndarray, tag_lengths: np.ndarray,
                result: LookupResult, device: torch.device) -> np.ndarray:  # fmt: skip
    """``[N, d]`` item-tower vectors: remote id / category rows, in-process tag rows."""
    assert result.pooled is not None
    pooled = {ms.inverse_names[k]: v.to(device) for k, v in result.pooled.to_dict().items()}
    pooled["tt_item_tags"] = mean_pool(tt.tables["tt_tag"], torch.from_numpy(tag_ids).to(device), torch.from_numpy(tag_lengths).to(device))
    dense = torch.from_numpy(item_dense_features(arrays, ids)).to(device)
    out: np.ndarray = tt.item_from_pooled(pooled, dense).float().cpu().numpy()
    return out


def _check_new_items(ids: np.ndarray, categories: np.ndarray, tag_ids: np.ndarray, tag_lengths: np.ndarray, *, n0: int, capacity: int,
                     num_categories: int, num_tags: int) -> None:  # fmt: skip
    """InvalidArgument naming the field unless ``ids`` are the next ids n0.. within the
    reserved rows, with one category each and ``tag_lengths`` summing to the tags."""
    n = int(ids.shape[0])
    if n == 0:
        raise InvalidArgument("item_ids is empty: give the new items' ids")
    if not np.array_equal(ids, np.arange(n0, n0 + n)):
        raise InvalidArgument(f"item_ids = {ids[:4].tolist()}... are not the next ids: new items take {n0}..{n0 + n - 1} in order")
    if n0 + n > capacity:
        raise ResourceExhausted(f"item_ids up to {n0 + n - 1} exceed the {capacity:,} item rows the export reserved (new_item_rows): re-train to add more")
    if categories.shape != (n,) or tag_lengths.shape != (n,):
        raise InvalidArgument(f"categories has {categories.shape[0]} and tag_lengths {tag_lengths.shape[0]} entries for {n} items: give one each")
    if int(tag_lengths.sum()) != tag_ids.shape[0] or (tag_lengths < 0).any():
        raise InvalidArgument(f"tag_lengths sum to {int(tag_lengths.sum())} but tag_ids has {tag_ids.shape[0]} ids")
    _check_range("categories", categories, num_categories)
    _check_range("tag_ids", tag_ids, num_tags)


def _check_range(field: str, ids: np.ndarray, n: int) -> None:
    bad = np.flatnonzero((ids < 0) | (ids >= n))
    if bad.size:
        i = int(bad[0])
        raise InvalidArgument(f"{field}[{i}] = {int(ids[i])} is out of range: use 0..{n - 1:,}")


def names_of(ms: ModelSet, feature: SparseFeature) -> str:
    return ms.feature_names[feature.name]


def _answers(ms: ModelSet, queries: list[Query], lay: B.BatchLayout, scores: np.ndarray, vectors: torch.Tensor | None, missing: np.ndarray) -> list[Answer]:
    """Split the batch's [P] scores per request, each sorted by score descending (one
    lexsort for the whole batch)."""
    order = np.lexsort((-scores, lay.pair_request))
    items, sorted_scores = lay.pair_items[order], scores[order].astype(np.float32)
    vec = vectors.float().cpu().numpy() if vectors is not None else None
    out = []
    offsets = lay.request_offsets.tolist()
    for r, q in enumerate(queries):  # per request, never per candidate
        lo, hi = offsets[r], offsets[r + 1]
        reasons = tuple(x for x, on in ((COLD_START, q.cold), (LOOKUP_MISSING, missing[r] > 0)) if on)
        out.append(Answer(
            model=q.model, model_version=ms.version, item_ids=items[lo:hi], scores=sorted_scores[lo:hi],
            vector=vec[r] if (vec is not None and q.kind is QueryKind.EMBED) else None, missing_rows=int(missing[r]), degraded_reasons=reasons,
        ))  # fmt: skip
    return out


def _check_items(field: str, ids: np.ndarray, num_items: int) -> None:
    bad = np.flatnonzero((ids < 0) | (ids >= num_items))
    if bad.size:
        i = int(bad[0])
        raise InvalidArgument(f"{field}[{i}] = {int(ids[i])} is out of range: item ids are 0..{num_items - 1:,} ({bad.size} ids out of range)")


def _kjt(keys: list[str], values: np.ndarray, lengths: np.ndarray) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys=keys, values=torch.from_numpy(values), lengths=torch.from_numpy(lengths))

