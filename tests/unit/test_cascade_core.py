"""CascadeCore's stage logic on in-memory arrays with a fake ranking client (explicit
state setters): L1 reorders L0's approximate output by exact scores, an RPC stage that
fails passes the previous order through, and k, exclusions and reports behave.

The oracle for L1 is numpy over the same vectors; for L0, faiss IndexFlatIP."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pytest

from cascade.export_view import ExportView
from cascade.index import IndexConfig, IndexHolder, build_index
from cascade.service import POPULARITY_PRIOR, CascadeCore
from recserve.catalog.storage import Csr
from recserve.client import EmbedResult, RankResult
from recserve.config.spec import CascadeConfig
from recserve.errors import Unavailable

N, D, USERS = 3000, 16, 50


class FakeRankingClient:
    """Answers EmbedUser with a set vector and Rank by a set per-item score table."""

    def __init__(self, vector: np.ndarray, item_scores: np.ndarray) -> None:
        self.vector = vector
        self.item_scores = item_scores
        self.failing: set[str] = set()  # models whose Rank raises Unavailable
        self.missing_rows = 0
        self.calls: list[tuple[str, int]] = []

    def set_failing(self, *models: str) -> None:
        self.failing = set(models)

    def set_missing_rows(self, n: int) -> None:
        self.missing_rows = n

    async def embed_user(self, user_id: int, **_: Any) -> EmbedResult:
        return EmbedResult(self.vector, "m-test", False, "", 0, "fake", 1)

    async def rank(self, user_id: int, candidate_ids: np.ndarray, *, model: str = "", **_: Any) -> RankResult:
        self.calls.append((model, int(candidate_ids.shape[0])))
        if model in self.failing:
            raise Unavailable(f"fake ranker: {model} is down")
        s = self.item_scores[candidate_ids]
        order = np.argsort(-s, kind="stable")
        reason = "lookup_missing" if self.missing_rows else ""
        return RankResult(candidate_ids[order], s[order].astype(np.float32), bool(self.missing_rows), reason, self.missing_rows, "m-test", model, "fake", 1)

    async def aclose(self) -> None:
        pass


def view(rng: np.random.Generator) -> ExportView:
    vectors = rng.standard_normal((N, D)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    hist_len = np.full(USERS, 5)
    return ExportView(
        path=Path("."), model_version="m-test", manifest={}, item_vectors=vectors,
        item_category=rng.integers(0, 20, N), item_impressions=rng.integers(0, 1000, N),
        user_history=Csr(rng.integers(0, N, int(hist_len.sum())), np.concatenate(([0], np.cumsum(hist_len)))),
    )  # fmt: skip


def core(rng: np.random.Generator, factory: str = "IVF32,PQ8") -> tuple[CascadeCore, FakeRankingClient, ExportView]:
    v = view(rng)
    index = build_index(np.asarray(v.item_vectors), None, IndexConfig(factory=factory, nprobe=4), model_version="m-test", progress=False)
    user = rng.standard_normal(D).astype(np.float32)
    client = FakeRankingClient(user / np.linalg.norm(user), rng.standard_normal(N).astype(np.float32))
    cfg = CascadeConfig(l0_out=300, l1_out=100, l2_out=30, l3_out=10, default_deadline_ms=10_000.0)
    return CascadeCore(cfg, v, IndexHolder(index), client), client, v  # type: ignore[arg-type]


def run(c: CascadeCore, user: int = 1, k: int = 10, **kw: np.ndarray) -> Any:
    q = c.query(user, k, kw.get("exclude", np.zeros(0, np.int64)), kw.get("recent", np.zeros(0, np.int64)), deadline=c.clock() + 10.0)
    return asyncio.run(c.recommend(q))


def test_l1_reorders_l0_by_exact_scores_plus_the_prior() -> None:
    rng = np.random.default_rng(0)
    c, client, v = core(rng)
    budget = c.planner.open(c.clock() + 10.0, c.clock())
    order, vector, _, _ = asyncio.run(c._l0(c.query(1, 10, np.zeros(0, np.int64), np.zeros(0, np.int64), deadline=c.clock() + 10.0), budget, 300, v.history(1), v.history(1), False, []))
    reports: list[Any] = []
    out = c._l1(budget, order, vector, False, 100, reports)
    exact = np.asarray(v.item_vectors)[order.ids] @ client.vector + c.prior[order.ids]
    want = order.ids[np.argsort(-exact, kind="stable")][:100]
    assert out.ids.tolist() == want.tolist()  # exactly the full-precision order
    assert out.ids.tolist() != order.ids[:100].tolist()  # and not L0's (PQ) order: L1 did something
    assert POPULARITY_PRIOR > 0 and not reports[0].degraded


def test_l0_finds_what_exact_search_finds_and_drops_seen_and_excluded() -> None:
    rng = np.random.default_rng(1)
    c, client, v = core(rng, factory="Flat")
    q = c.query(2, 10, np.array([5, 6]), np.array([7]), deadline=c.clock() + 10.0)
    budget = c.planner.open(q.deadline, c.clock())
    seen = np.concatenate((v.history(2), q.recent, q.exclude))
    order, _, _, _ = asyncio.run(c._l0(q, budget, 300, v.history(2), seen, False, []))
    flat = faiss.IndexFlatIP(D)
    flat.add(np.asarray(v.item_vectors))
    _, top = flat.search(client.vector[None, :], 400)
    banned = set(seen.tolist())
    exact = [i for i in top[0].tolist() if i not in banned]
    hits = order.ids[np.isfinite(order.scores)]  # index hits first, then popular-only items (-inf)
    assert order.ids.shape == (300,) and not set(order.ids.tolist()) & banned
    assert hits.tolist() == exact[: hits.shape[0]] and hits.shape[0] >= 250


def test_a_failing_rank_stage_passes_the_previous_order_through() -> None:
    rng = np.random.default_rng(2)
    c, client, _ = core(rng)
    healthy = run(c)
    client.set_failing("l3")
    res = run(c)
    assert [r.degraded_reason.value for r in res.reports] == ["", "", "", "timeout"]
    assert res.degraded and res.degraded_reason == "timeout"
    # L3 gone: the answer is L2's order, which is what the healthy run fed to L3.
    client.set_failing()
    assert len(res.item_ids) == 10 and len(healthy.item_ids) == 10
    client.set_missing_rows(4)
    missed = run(c)
    l2 = missed.reports[2]
    assert l2.degraded_reason.value == "lookup_missing" and l2.coverage == pytest.approx((100 - 4) / 100) and missed.coverage < 1.0
    assert [m for m, _ in client.calls[-2:]] == ["dlrm", "l3"]


def test_sizes_follow_the_config_and_k() -> None:
    rng = np.random.default_rng(3)
    c, client, _ = core(rng)
    res = run(c, k=5)
    assert [r.out_count for r in res.reports] == [300, 100, 30, 5] and len(res.item_ids) == 5
    assert client.calls[-2:] == [("dlrm", 100), ("l3", 30)]



def test_a_shrunk_l0_scans_proportionally_fewer_lists() -> None:
    from cascade.budget import DecisionKind, Stage, StageDecision
    from cascade.service import _knobs

    rng = np.random.default_rng(4)
    v = view(rng)
    ivf = build_index(np.asarray(v.item_vectors), None, IndexConfig(factory="IVF32,Flat", nprobe=16), progress=False)
    flat = build_index(np.asarray(v.item_vectors), None, IndexConfig(factory="Flat"), progress=False)
    run_all = StageDecision(Stage.L0, DecisionKind.RUN, 300, 300, 0.01, 0.0, 0.001)
    half = StageDecision(Stage.L0, DecisionKind.SHRINK, 300, 150, 0.01, 0.0, 0.001)
    assert _knobs(ivf, 300, run_all) == (None, None)  # the index's own knob
    assert _knobs(ivf, 300, half) == (8, None)
    assert _knobs(flat, 300, half) == (None, None)  # exact: nothing to tune


def test_l0_is_never_skipped_for_its_budget() -> None:
    """A cost model that predicts L0 far over its share (a cold first sample) must not
    leave the request with popular items only: L0 runs anyway, and L1 gets a user vector."""
    rng = np.random.default_rng(5)
    c, _, _ = core(rng)
    c.planner = type(c.planner)(dataclasses.replace(c.config, cost_prior_fixed_ms=(5_000.0, 1.0, 1.0, 1.0), default_deadline_ms=2_000.0))
    q = c.query(1, 10, np.zeros(0, np.int64), np.zeros(0, np.int64), deadline=c.clock() + 2.0)
    res = asyncio.run(c.recommend(q))
    l0, l1 = res.reports[0], res.reports[1]
    assert l0.degraded_reason.value == "" and l0.scored > 0
    assert l1.scored > 0 and l1.degraded_reason.value != "cold_start"
