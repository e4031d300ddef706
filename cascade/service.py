"""The cascade's core: one ``Recommend`` through L0-L3 within its deadline
(docs/architecture.md §8; reference §10.15.4, Table 28).

Stages, each planned by :class:`~cascade.budget.StagePlanner` (RUN, SHRINK to the
best-scored prefix that fits, or SKIP so the previous order passes through):

- **L0** (this process; never skipped for its budget, see :meth:`CascadeCore._l0`): the user vector from ``Ranking.EmbedUser`` (with the request's
  ``recent_item_ids`` as extra history), an approximate FAISS search
  (:mod:`cascade.index`), merged with popular items of the user's recent categories
  (:mod:`cascade.sources`); the request's ``exclude_ids``, its recent items and the
  user's exported history are removed. A user the models have never seen and with no
  recent items gets the globally popular items (``cold_start``).
- **L1** (this process): exact full-precision two-tower scores plus a popularity prior,
  one matmul over L0's candidates.
- **L2**: DLRM through ``Ranking.Rank`` (routed by :class:`~recserve.client.RankingClient`:
  two choices, breakers, one retry budget; the rankers batch concurrent requests, the
  cascade does not re-batch).
- **L3**: the sequence reranker through ``Rank(model="l3")``.

An RPC stage is bounded by its stage deadline. One that fails or runs out of time
passes the previous order through (``timeout``); one whose lookups missed rows reports
``lookup_missing`` with its coverage. Each response's ``scores`` are those of the last
stage that scored each item (a stage that shrank leaves the tail with earlier scores),
so only the order is comparable across items, not the scale.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from cascade.budget import DecisionKind, RequestBudget, Stage, StageDecision, StagePlanner, resolve_k, stage_sizes_for
from cascade.export_view import ExportView, open_export_view
from cascade.index import IndexConfig, IndexHolder, RetrievalIndex, SearchKnob, build_index
from cascade.report import DegradedReason, StageReport, summarize
from cascade.serving_log import ServingLog
from cascade.sources import PopularByCategory, merge_candidates, recent_categories
from recserve.client import RankingClient
from recserve.config.spec import CascadeConfig, ClusterConfig, TlsConfig
from recserve.errors import Cancelled, DeadlineExceeded, FailedPrecondition, InvalidArgument, RecserveError, ResourceExhausted, Unavailable
from recserve.scheduling import AdmissionConfig, Batch, Done, DynamicBatchConfig, DynamicBatchPolicy, Failed, Scheduler, ServingLoop

log = logging.getLogger(__name__)

# L1's popularity prior: score = u·v + POPULARITY_PRIOR · log1p(impressions) / log1p(max).
# The two-tower was trained with most of the logQ popularity correction applied, so its
# inner products under-rate popular items that the click model still favours.
POPULARITY_PRIOR = 0.05
# The request id of the deep check's fixed Recommend (cascade/server.py): served like any
# call, but not an impression, so it stays out of the serving log.
PROBE_REQUEST_ID = "recserve-deep-check"
# Faults an RPC stage absorbs by passing the previous order through.
PASS_THROUGH = (DeadlineExceeded, Unavailable, ResourceExhausted)


@dataclasses.dataclass(frozen=True)
class RecommendQuery:
    """One validated request (ids int64; ``deadline`` monotonic seconds)."""

    user_id: int
    k: int
    exclude: np.ndarray
    recent: np.ndarray
    deadline: float
    tenant: str = "default"
    priority: str = "standard"
    request_id: str = ""


@dataclasses.dataclass(frozen=True)
class Recommendation:
    item_ids: np.ndarray  # int64 [k']
    scores: np.ndarray  # float32 [k']
    reports: list[StageReport]
    coverage: float
    degraded: bool
    degraded_reason: str
    index_version: str
    model_version: str


@dataclasses.dataclass
class _DoorCall:
    """One Recommend in the door: the query, the benchmark trace, the caller's context
    (copied at submit) and, while it runs, its task."""

    query: RecommendQuery
    trace: dict[Stage, np.ndarray] | None
    context: contextvars.Context
    task: asyncio.Task[Recommendation] | None = None


@dataclasses.dataclass
class _Order:
    """The candidates in their current order, with the scores that ordered them."""

    ids: np.ndarray  # int64 [n]
    scores: np.ndarray  # float32 [n]

    def head(self, n: int) -> _Order:
        return _Order(self.ids[:n], self.scores[:n])


class CascadeCore:
    """Runs Recommend requests (see the module docstring)."""

    def __init__(self, config: CascadeConfig, view: ExportView, index: IndexHolder, client: RankingClient, *,
                 shard_addresses: Sequence[str] = (), admin_token: str = "", clock: Callable[[], float] = time.monotonic, serving_log: ServingLog | None = None,
                 tls: TlsConfig | None = None) -> None:  # fmt: skip
        self.config = config
        self.view = view
        self.index = index
        self.client = client
        self.clock = clock
        self.planner = StagePlanner(config)
        self.popular = PopularByCategory(np.asarray(view.item_category), np.asarray(view.item_impressions), per_category=config.popular_per_category)
        imp = np.log1p(np.asarray(view.item_impressions, dtype=np.float32))
        self.prior = (POPULARITY_PRIOR * imp / max(float(imp.max()), 1e-6)).astype(np.float32)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="cascade-l0")
        self.shard_addresses = tuple(shard_addresses)
        self.admin_token = admin_token  # sent as 'authorization: Bearer' metadata on AddItems' calls
        self.tls = tls  # the rankers' [tls] (AddItems' own channels)
        self.num_categories = int(view.manifest["catalog"]["categories"]) if view.manifest else int(np.asarray(view.item_category).max()) + 1
        self._means: dict[str, np.ndarray] = {}
        self._adding = asyncio.Lock()
        self.requests = 0
        # The impression log (cascade/serving_log.py): injected, or cascade.log_path (None when "").
        self.serving_log = serving_log if serving_log is not None else ServingLog.from_config(config)
        # The door: calls one at a time through the scheduler core, up to max_concurrent
        # running; its admission sheds a call whose slack is below the queue wait ahead
        # plus a call's measured duration (recserve/scheduling/core.py). Started by the
        # first call, on its event loop, so the core can be built outside one.
        self.door = self._new_door()
        self._door_loop: asyncio.AbstractEventLoop | None = None

    def _new_door(self) -> ServingLoop:
        policy = DynamicBatchPolicy(DynamicBatchConfig(max_batch_cost=1.0, max_wait_ms=0.0, adaptive=False))
        scheduler = Scheduler(policy, AdmissionConfig(shed_by_slack=self.config.shed_by_slack))
        return ServingLoop(scheduler, self._run_door, self.config.max_concurrent, clock=self.clock, name="cascade")

    async def aclose(self) -> None:
        if self._door_loop is None or self._door_loop is asyncio.get_running_loop():  # (not one a test's earlier loop ran)
            await self.door.aclose()  # drains the calls already admitted
        await self.client.aclose()
        self._executor.shutdown(wait=True)
        if self.serving_log is not None:  # writes what is still queued
            await asyncio.to_thread(self.serving_log.close)

    @property
    def index_version(self) -> str:
        return self.index.current.index_version

    def index_items(self) -> int:
        return self.index.current.ntotal

    # ---- requests --------------------------------------------------------------------

    def query(self, user_id: int, k: int, exclude: np.ndarray, recent: np.ndarray, *, deadline: float,
              tenant: str = "default", priority: str = "standard", request_id: str = "") -> RecommendQuery:  # fmt: skip
        """Validate one request (InvalidArgument naming the field and the value)."""
        n = self.view.num_items
        if user_id < 0:
            raise InvalidArgument(f"user_id = {user_id} is invalid: use a user id >= 0 (ids beyond the {self.view.num_users:,} known users are new users)")
        resolve_k(self.config, k, n)
        for field, ids in (("exclude_ids", exclude), ("recent_item_ids", recent)):
            bad = np.flatnonzero((ids < 0) | (ids >= n))
            if bad.size:
                i = int(bad[0])
                raise InvalidArgument(f"{field}[{i}] = {int(ids[i])} is out of range: item ids are 0..{n - 1:,}")
        return RecommendQuery(user_id, k, exclude, recent, deadline, tenant, priority, request_id)

    async def recommend(self, q: RecommendQuery, *, trace: dict[Stage, np.ndarray] | None = None) -> Recommendation:
        """Run ``q`` through the door, then L0-L3. Raises ResourceExhausted (with a retry
        hint) when it is shed, DeadlineExceeded when its deadline passes before it starts
        (no stage runs). ``trace`` (benchmarks: ``recserve bench recall``), when given,
        receives each stage's output ids in order (int64 ``[n_stage]``)."""
        loop = asyncio.get_running_loop()
        if self._door_loop is not loop:  # the first call (or, in tests, a new event loop)
            if self._door_loop is not None:
                self.door = self._new_door()
            self.door.start()  # (its driver runs in an empty context: ServingLoop.start)
            self._door_loop = loop
        # The slack check's service time: a whole undegraded call (the stages' cost
        # model, StagePlanner.full_service_s) plus the reply margin, when that is more
        # than the door's measured call time. Under overload calls degrade, and
        # degraded calls are short, so the measured time alone kept admitting calls into
        # degradation (3x burst on a 42/s knee: goodput 0.07 of the knee; 0.93 with it).
        need_s = self.planner.full_service_s(stage_sizes_for(self.config, self.view.num_items, q.k)) + self.config.reply_margin_ms / 1e3
        call = _DoorCall(q, trace, contextvars.copy_context())
        try:
            result: Recommendation = await self.door.submit(call, deadline=q.deadline, tenant=q.tenant, priority=q.priority,
                                                            request_id=q.request_id or None, min_service_s=need_s)  # fmt: skip
        except asyncio.CancelledError:
            if call.task is not None:  # running: its ranker calls are cancelled with it
                call.task.cancel()
            raise
        return result

    async def _run_door(self, batch: Batch) -> list[Done | Failed]:
        """The door's runner: one call per batch (max_batch_cost 1), run as its own task
        in its caller's context (the caller's key goes to the rankers, its request id
        into the logs), so the caller's cancellation can cancel it mid-stage."""
        call: _DoorCall = batch.handles[0].item.payload
        task = asyncio.get_running_loop().create_task(self._recommend(call.query, call.trace), context=call.context)
        call.task = task
        try:
            return [Done(await task)]
        except asyncio.CancelledError:
            if not task.cancelled():
                raise  # the runner itself was cancelled
            return [Failed(Cancelled(f"request {call.query.request_id or call.query.user_id}: cancelled by its caller"))]
        except RecserveError as exc:
            return [Failed(exc)]
        finally:
            call.task = None

    async def _recommend(self, q: RecommendQuery, trace: dict[Stage, np.ndarray] | None) -> Recommendation:
        budget = self.planner.open(q.deadline, self.clock())  # DEADLINE_EXCEEDED before any stage
        sizes = stage_sizes_for(self.config, self.view.num_items, q.k)
        history = self.view.history(q.user_id)
        seen = np.concatenate((history, q.recent, q.exclude))
        cold = q.user_id >= self.view.num_users
        reports: list[StageReport] = []
        order, user_vector, index_version, cold = await self._l0(q, budget, sizes.l0, history, seen, cold, reports)
        if trace is not None:
            trace[Stage.L0] = order.ids
        order = self._l1(budget, order, user_vector, cold, sizes.l1, reports)
        if trace is not None:
            trace[Stage.L1] = order.ids
        order = await self._rank_stage(Stage.L2, "dlrm", q, budget, order, sizes.l2, reports)
        if trace is not None:
            trace[Stage.L2] = order.ids
        order = await self._rank_stage(Stage.L3, "l3", q, budget, order, sizes.l3, reports)
        if trace is not None:
            trace[Stage.L3] = order.ids[: sizes.l3]
        summary = summarize(reports, cold_start=cold)
        self.requests += 1
        rec = Recommendation(
            item_ids=order.ids[: sizes.l3], scores=order.scores[: sizes.l3].astype(np.float32), reports=reports, coverage=summary.coverage,
            degraded=summary.degraded, degraded_reason=summary.degraded_reason.value, index_version=index_version, model_version=self.view.model_version,
        )  # fmt: skip
        # ---- serving log (cascade/serving_log.py): encode + enqueue, the file is written off the loop
        if self.serving_log is not None and q.request_id != PROBE_REQUEST_ID:
            self.serving_log.append(q.request_id, q.user_id, rec)
        return rec

    # ---- stages ----------------------------------------------------------------------

    async def _l0(self, q: RecommendQuery, budget: RequestBudget, n_out: int, history: np.ndarray, seen: np.ndarray, cold: bool,
                  reports: list[StageReport]) -> tuple[_Order, np.ndarray | None, str, bool]:  # fmt: skip
        t0 = self.clock()
        decision = self.planner.plan(budget, Stage.L0, n_out, t0)
        if decision.kind is DecisionKind.SKIP and budget.remaining_s(t0) > 0:
            # L0 is never skipped for its budget: without a user vector every later stage
            # has only popular items to work on (`recserve bench recall` at 100 ms: 943 of
            # 946 L2 misses came from skipped L0s, whose share is smaller than the EmbedUser
            # RPC inside it). It may run into the later stages' time, bounded by the
            # request's reply-by time; they then shrink or skip and pass L1's order on.
            decision = dataclasses.replace(decision, kind=DecisionKind.RUN, n_run=n_out, deadline_s=budget.reply_by_s, predicted_s=0.0)
        index = self.index.current  # one index for the whole request, whatever a refresh does meanwhile
        reason = DegradedReason.NONE
        vector: np.ndarray | None = None
        if decision.kind is not DecisionKind.SKIP and (not cold or q.recent.size):
            try:
                emb = await self.client.embed_user(q.user_id, history_item_ids=q.recent, deadline=decision.deadline_s)
                vector = np.asarray(emb.vector, dtype=np.float32)
                cold = cold or "cold_start" in emb.degraded_reason.split(",")
            except PASS_THROUGH as exc:
                log.debug("L0 EmbedUser failed: %s", exc)
                reason = DegradedReason.TIMEOUT
        recent_cats = recent_categories(np.concatenate((history, q.recent)), np.asarray(self.view.item_category))
        n_run = decision.n_run if decision.kind is not DecisionKind.SKIP else n_out
        secondary = self.popular.candidates(recent_cats, max(1, n_run // 10)) if recent_cats.size else self.popular.global_top(n_run + seen.size)
        if vector is not None:
            k = min(index.ntotal, n_run + seen.size)  # room for the items removed afterwards
            loop = asyncio.get_running_loop()
            nprobe, ef_search = _knobs(index, k, decision)
            ids, scores, index_version = await loop.run_in_executor(
                self._executor, lambda: index.search_versioned(vector[None, :], k, nprobe=nprobe, ef_search=ef_search)
            )
            # The popular source keeps its share (a tenth) even when the index alone could fill L0.
            merged = merge_candidates(ids[0], scores[0], secondary, q.exclude, seen, limit=n_run, secondary_min=secondary.size)
            order = _Order(merged.ids, merged.scores)
        else:  # no user vector (new user without history, or EmbedUser failed): popular items
            merged = merge_candidates(np.zeros(0, np.int64), np.zeros(0, np.float32), secondary, q.exclude, seen, limit=n_run)
            order = _Order(merged.ids, np.take(self.prior, merged.ids))
            index_version = index.index_version
            if reason is DegradedReason.NONE:
                reason = DegradedReason.COLD_START if cold else DegradedReason.SKIPPED_BUDGET
        elapsed = self.clock() - t0
        scored = order.ids.shape[0] if vector is not None else 0
        reports.append(self.planner.finish(decision, elapsed, order.ids.shape[0], scored=min(scored, decision.n_in), reason=reason))
        return order, vector, index_version, cold

    def _l1(self, budget: RequestBudget, order: _Order, vector: np.ndarray | None, cold: bool, n_out: int, reports: list[StageReport]) -> _Order:
        t0 = self.clock()
        decision = self.planner.plan(budget, Stage.L1, order.ids.shape[0], t0)
        if vector is None:  # nothing to score with: L0's popular order passes through
            out = order.head(n_out)
            reason = DegradedReason.COLD_START if cold else DegradedReason.TIMEOUT
            reports.append(self.planner.finish(_skipped(decision), self.clock() - t0, out.ids.shape[0], scored=0, reason=reason))
            return out
        if decision.kind is DecisionKind.SKIP:
            out = order.head(n_out)
            reports.append(self.planner.finish(decision, self.clock() - t0, out.ids.shape[0], scored=0))
            return out
        head, tail = order.ids[: decision.n_run], order.ids[decision.n_run :]
        # One matmul: [n, d] @ [d] exact item-tower scores, plus the popularity prior.
        scores = np.asarray(np.take(self.view.item_vectors, head, axis=0) @ vector, dtype=np.float32) + np.take(self.prior, head)
        best = np.argsort(-scores, kind="stable")
        out = _Order(np.concatenate((head[best], tail)), np.concatenate((scores[best], order.scores[decision.n_run :]))).head(n_out)
        reports.append(self.planner.finish(decision, self.clock() - t0, out.ids.shape[0]))
        return out

    async def _rank_stage(self, stage: Stage, model: str, q: RecommendQuery, budget: RequestBudget, order: _Order, n_out: int,
                          reports: list[StageReport]) -> _Order:  # fmt: skip
        t0 = self.clock()
        decision = self.planner.plan(budget, stage, order.ids.shape[0], t0)
        if decision.kind is DecisionKind.SKIP or decision.n_run == 0:
            out = order.head(n_out)
            reports.append(self.planner.finish(decision, self.clock() - t0, out.ids.shape[0], scored=0))
            return out
        head = order.ids[: decision.n_run]
        try:
            res = await self.client.rank(q.user_id, head, model=model, history_item_ids=q.recent, deadline=decision.deadline_s,
                                         tenant=q.tenant, priority=q.priority)  # fmt: skip
        except PASS_THROUGH as exc:
            log.debug("%s Rank failed: %s", stage.name, exc)
            out = order.head(n_out)
            reports.append(self.planner.finish(decision, self.clock() - t0, out.ids.shape[0], scored=0, reason=DegradedReason.TIMEOUT))
            return out
        except RecserveError:
            raise
        out = _Order(np.concatenate((np.asarray(res.item_ids), order.ids[decision.n_run :])),
                     np.concatenate((np.asarray(res.scores), order.scores[decision.n_run :]))).head(n_out)  # fmt: skip
        # A missing row affects at most one candidate: scored is a lower bound on the
        # candidates scored with all their rows.
        missing = min(int(res.missing_rows), decision.n_run)
        reason = DegradedReason.LOOKUP_MISSING if "lookup_missing" in res.degraded_reason.split(",") else DegradedReason.NONE
        reports.append(self.planner.finish(decision, self.clock() - t0, out.ids.shape[0], scored=decision.n_run - missing, reason=reason))
        return out

    # ---- admin -----------------------------------------------------------------------

    async def add_items(self, ids: np.ndarray, categories: np.ndarray, tag_ids: np.ndarray, tag_lengths: np.ndarray) -> tuple[str, int, int]:
        """New items, retrievable at once without a rebuild (returns index version, items
        added, shard rows written):

        1. their rows in every item-keyed shard table (the export reserved
           ``new_item_rows`` past the catalog): the mean row of their category's items, a
           neutral start that puts a new item among its category's typical items;
        2. every ranker learns their categories and tags (``Admin.AddItems``), and one
           returns their item-tower vectors, computed on those rows;
        3. the vectors join the L0 index and L1's arrays.

        Ids must be the next ones (the rankers check it, and a retry after a partial
        failure repeats steps 1-2 idempotently)."""
        async with self._adding:
            view = self.view
            n0, n = view.num_items, int(ids.shape[0])
            if n == 0 or not np.array_equal(ids, np.arange(n0, n0 + n)):
                raise InvalidArgument(f"item_ids = {ids[:4].tolist()}... are not the next ids: new items take {n0}..{n0 + n - 1} in order")
            if categories.shape != (n,) or int(categories.min()) < 0 or int(categories.max()) >= self.num_categories:
                raise InvalidArgument(f"categories: give one category in 0..{self.num_categories - 1} per item ({n})")
            upserted = await self._upsert_category_means(ids, categories)
            vectors = await self._rankers_add_items(ids, categories, tag_ids, tag_lengths)
            index = self.index.current
            version = await asyncio.get_running_loop().run_in_executor(self._executor, index.add, ids, vectors)
            self.view = dataclasses.replace(
                view, item_vectors=np.concatenate((np.asarray(view.item_vectors), vectors)), item_category=np.concatenate((np.asarray(view.item_category), categories)),
                item_impressions=np.concatenate((np.asarray(view.item_impressions), np.zeros(n, np.int64))),
            )  # fmt: skip
            self.prior = np.concatenate((self.prior, np.zeros(n, np.float32)))
            log.info("added items %d..%d to index %s", n0, n0 + n - 1, version)
            return version, n, upserted

    async def _upsert_category_means(self, ids: np.ndarray, categories: np.ndarray) -> int:
        from recserve.lookup.transport import GrpcShardTransport
        from recserve.lookup.upsert import send_upsert
        from recserve.rpc.deadline import make_header
        from recserve.sharding.plan import ShardingPlan

        if not self.shard_addresses:
            raise FailedPrecondition("AddItems needs the shards' addresses (--shards) to write the new items' rows")
        transport = GrpcShardTransport(self.shard_addresses)
        try:
            plan = ShardingPlan.from_json((await transport.get_plan(0, 10.0)).plan_json)
            written = 0
            for table in self.view.manifest.get("item_tables", []):
                rows = np.take(await asyncio.to_thread(self._category_means, table), categories, axis=0)
                acks = await send_upsert(transport, plan, table, ids, rows, header=make_header(timeout_s=30.0), admin_token=self.admin_token, timeout_s=30.0)  # as metadata
                written += sum(acks.values())
            return written
        finally:
            await transport.close()

    def _category_means(self, table: str) -> np.ndarray:
        """[C, D] f32: the mean exported row of each category's items (cached)."""
        if table not in self._means:
            rows = np.load(self.view.path / "embeddings" / f"{table}.npy", mmap_mode="r")
            n = int(self.view.manifest["catalog"]["items"])
            cat = np.asarray(self.view.item_category[:n])
            sums = np.zeros((self.num_categories, rows.shape[1]), np.float64)
            np.add.at(sums, cat, np.asarray(rows[:n], dtype=np.float64))
            counts = np.maximum(np.bincount(cat, minlength=self.num_categories), 1)[:, None]
            self._means[table] = (sums / counts).astype(np.float32)
        return self._means[table]

    async def _rankers_add_items(self, ids: np.ndarray, categories: np.ndarray, tag_ids: np.ndarray, tag_lengths: np.ndarray) -> np.ndarray:
        """Admin.AddItems on every ranker (all must learn the items); their vectors [N, d]."""
        import grpc

        from recserve.rpc.auth import admin_metadata, open_channel
        from recserve.rpc.deadline import make_header
        from recserve.rpc.status import error_from_code
        from recserve.rpc.tensors import pack, unpack
        from recserve.v1 import admin_pb2
        from recserve.v1.admin_pb2_grpc import AdminStub

        request = admin_pb2.AddItemsRequest(header=make_header(timeout_s=30.0), item_ids=pack(ids), categories=pack(categories), tag_ids=pack(tag_ids),
                                            tag_lengths=pack(tag_lengths))  # fmt: skip
        vectors: np.ndarray | None = None
        for address in self.client.addresses:  # a handful of replicas, once per AddItems
            async with open_channel(address, self.tls) as channel:
                try:
                    reply = await AdminStub(channel).AddItems(request, timeout=30.0, metadata=admin_metadata(self.admin_token))
                except grpc.aio.AioRpcError as exc:
                    raise error_from_code(exc.code(), f"ranker {address}: AddItems: {exc.details()}") from None
            if vectors is None:
                vectors = np.array(unpack(reply.vectors, "AddItemsResponse.vectors", expect_ndim=2), dtype=np.float32)
        assert vectors is not None
        return vectors

    async def refresh_index(self, index_path: str) -> tuple[str, str]:
        """Swap in a saved index (``index_path``) or one rebuilt from the export's item
        vectors; returns (new, previous) index versions. Requests already searching
        finish on the old index (they hold their own reference)."""
        view = self.view
        loop = asyncio.get_running_loop()
        if index_path:
            new = await loop.run_in_executor(None, lambda: RetrievalIndex.load(index_path, dim=int(view.item_vectors.shape[1]), model_version=view.model_version))
        else:
            cfg = self.index.current.config
            new = await loop.run_in_executor(None, lambda: build_index(np.asarray(view.item_vectors), None, cfg, model_version=view.model_version, progress=False))
        old = self.index.swap(new)
        log.info("index refreshed: %s -> %s", old.index_version, new.index_version)
        return new.index_version, old.index_version


def _knobs(index: RetrievalIndex, k: int, decision: StageDecision) -> tuple[int | None, int | None]:
    """(nprobe, ef_search) for L0's search: the index's own (config or automatic) unless
    the stage budget shrank L0, which then scans proportionally fewer lists / visits
    proportionally fewer graph nodes (search time is about linear in the knob)."""
    if decision.kind is not DecisionKind.SHRINK or decision.n_in <= 0 or index.knob is SearchKnob.NONE:
        return None, None
    knob = max(1, int(index.default_knob(k) * decision.n_run / decision.n_in))
    return (knob, None) if index.knob is SearchKnob.NPROBE else (None, knob)


def _skipped(decision: StageDecision) -> StageDecision:
    """``decision`` as a SKIP (a stage that could not run at all, e.g. no user vector)."""
    return dataclasses.replace(decision, kind=DecisionKind.SKIP, n_run=0, predicted_s=0.0)


def index_config(config: CascadeConfig) -> IndexConfig:
    return IndexConfig(factory=config.index_factory, nprobe=config.nprobe or None, ef_search=config.ef_search or None)


async def open_cascade(cluster: ClusterConfig, models_dir: str | Path, ranker_addresses: Sequence[str], *, shard_addresses: Sequence[str] = (),
                       admin_token: str = "", index_dir: str = "", progress: bool = True) -> CascadeCore:  # fmt: skip
    """Open the export, load (``index_dir``) or build the L0 index, connect to the rankers."""
    view = await asyncio.to_thread(open_export_view, models_dir)
    if index_dir:
        index = await asyncio.to_thread(RetrievalIndex.load, index_dir, dim=int(view.item_vectors.shape[1]), model_version=view.model_version)
    else:
        index = await asyncio.to_thread(build_index, np.asarray(view.item_vectors), None, index_config(cluster.cascade), model_version=view.model_version, progress=progress)
    client = RankingClient(ranker_addresses, cluster.routing, tls=cluster.tls)
    await client.start()
    return CascadeCore(cluster.cascade, view, IndexHolder(index), client, shard_addresses=shard_addresses, admin_token=admin_token, tls=cluster.tls)
