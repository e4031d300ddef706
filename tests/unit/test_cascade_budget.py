"""The cascade's budget state machine (cascade/budget.py, cascade/report.py; issue 12
"Deadlines and fallbacks"): cost model, RUN / SHRINK / SKIP, the budget rule, the reply
margin, coverage. Pure: a fake clock is a float the test advances."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from cascade.budget import (
    DecisionKind,
    RequestBudget,
    Stage,
    StageCostModel,
    StagePlanner,
    plan_stage,
    resolve_k,
    stage_budget_s,
    stage_sizes_for,
)
from cascade.report import DegradedReason, StageReport, overall_coverage, summarize, to_proto
from recserve.config import CascadeConfig
from recserve.errors import DeadlineExceeded, InvalidArgument

MS = 1e-3
US = 1e-6


def exact_model(fixed_s: float, per_item_s: float) -> StageCostModel:
    """A warm model with no margin that has seen an exact line at n = 0 and n = 1000."""
    m = StageCostModel(fixed_s, per_item_s, quantile=0.0, min_samples=0)
    for n in (0, 1000) * 20:
        m.observe(n, fixed_s + per_item_s * n)
    return m


# ----------------------------------------------------------------------------- cost model


def test_cold_model_plans_with_the_prior_and_never_below_it() -> None:
    cfg = CascadeConfig()
    m = StageCostModel.from_config(cfg, Stage.L2)  # prior 5 ms + 20 us per candidate
    assert not m.warm and m.count == 0
    assert m.predict(1000) == pytest.approx(5 * MS + 1000 * 20 * US)
    assert m.max_fit(15 * MS) == pytest.approx(500)  # (15 - 5) ms / 20 us
    # Two measurements far cheaper than the prior: still cold, still planned at the prior.
    m.observe(1000, 2 * MS)
    m.observe(500, 1 * MS)
    assert not m.warm
    assert m.predict(1000) == pytest.approx(25 * MS)
    m.observe(1000, 2 * MS)  # the third makes it warm: the data alone from now on
    assert m.warm and m.predict(1000) < 5 * MS


def test_model_converges_to_a_known_fixed_part_and_slope() -> None:
    rng = np.random.default_rng(0)
    m = StageCostModel(5 * MS, 20 * US, alpha=0.1, quantile=0.9)  # prior far from the truth
    for n in rng.integers(10, 2000, size=400):
        m.observe(int(n), 2 * MS + 5 * US * int(n))
    assert m.fixed_s == pytest.approx(2 * MS, rel=0.02)
    assert m.per_item_s == pytest.approx(5 * US, rel=0.02)
    assert m.margin < 0.01  # noise-free: the last window's errors are ~0
    assert m.predict(1000) == pytest.approx(7 * MS, rel=0.02)


def test_constant_n_splits_its_cost_with_the_prior_slope() -> None:
    # L3 always sees 100 candidates: no spread to fit a slope from, yet a shrink must be
    # predictable. The mean cost at n = 100 is kept exactly; the slope is the prior's.
    m = StageCostModel(5 * MS, 100 * US, quantile=0.0)
    for _ in range(50):
        m.observe(100, 12 * MS)
    assert m.predict(100) == pytest.approx(12 * MS)
    assert m.per_item_s == pytest.approx(100 * US, rel=1e-6)
    assert m.fixed_s == pytest.approx(2 * MS)
    assert m.predict(50) == pytest.approx(7 * MS)


def test_quantile_margin_covers_that_share_of_jittery_costs() -> None:
    rng = np.random.default_rng(1)
    m = StageCostModel(1 * MS, 10 * US, alpha=0.05, quantile=0.9, window=64)

    def cost() -> float:
        return (1 * MS + 10 * US * 500) * (1.0 + rng.exponential(0.3))

    for _ in range(300):
        m.observe(500, cost())
    assert m.margin > 0.1  # a jittery stage plans with headroom
    fresh = np.array([cost() for _ in range(4000)])
    over = float(np.mean(fresh > m.predict(500)))
    assert 0.02 < over < 0.25, over  # ~10 % above the p90 prediction; without margin ~40 %
    no_margin = StageCostModel(1 * MS, 10 * US, alpha=0.05, quantile=0.0)
    for _ in range(300):
        no_margin.observe(500, cost())
    assert float(np.mean(fresh > no_margin.predict(500))) > 0.3


# ----------------------------------------------------------------------------- decisions


def test_run_shrink_skip_around_the_prediction() -> None:
    m = exact_model(1 * MS, 10 * US)
    full = m.predict(1000)
    assert full == pytest.approx(11 * MS, rel=1e-3)
    run = plan_stage(m, Stage.L2, 1000, full * 1.001, now_s=5.0)
    assert (run.kind, run.n_run, run.reason) == (DecisionKind.RUN, 1000, DegradedReason.NONE)
    assert run.deadline_s == pytest.approx(5.0 + full * 1.001)
    shrink = plan_stage(m, Stage.L2, 1000, 6 * MS, now_s=5.0)
    assert shrink.kind is DecisionKind.SHRINK and shrink.reason is DegradedReason.SHRUNK_INPUT
    # The count that fits: n' fits the budget and n' + 1 does not.
    assert m.predict(shrink.n_run) <= 6 * MS < m.predict(shrink.n_run + 1)
    assert shrink.n_run == pytest.approx(500, abs=2)
    assert shrink.predicted_s == pytest.approx(m.predict(shrink.n_run))
    skip = plan_stage(m, Stage.L2, 1000, 0.9 * MS, now_s=5.0)  # not even the fixed part fits
    assert (skip.kind, skip.n_run, skip.reason) == (DecisionKind.SKIP, 0, DegradedReason.SKIPPED_BUDGET)
    # A fit below min_n is not worth running.
    assert plan_stage(m, Stage.L2, 1000, 1.05 * MS, now_s=5.0, min_n=10).kind is DecisionKind.SKIP
    assert plan_stage(m, Stage.L2, 1000, 1.05 * MS, now_s=5.0, min_n=1).kind is DecisionKind.SHRINK
    # A budget under min_stage_s is skipped whatever the model says.
    cheap = exact_model(0.0, 0.0)
    assert plan_stage(cheap, Stage.L1, 10, 0.4 * MS, now_s=0.0, min_stage_s=0.5 * MS).kind is DecisionKind.SKIP
    assert plan_stage(cheap, Stage.L1, 10, 0.6 * MS, now_s=0.0, min_stage_s=0.5 * MS).kind is DecisionKind.RUN
    empty = plan_stage(m, Stage.L3, 0, 0.0, now_s=0.0)  # nothing to score: not degraded
    assert (empty.kind, empty.n_run, empty.reason) == (DecisionKind.RUN, 0, DegradedReason.NONE)


def test_budget_shares_split_what_remains_and_unused_time_flows_forward() -> None:
    cfg = CascadeConfig(budget_shares=(0.1, 0.2, 0.3, 0.4), reply_margin_ms=0.0)
    shares = cfg.budget_shares
    # Every stage using exactly its budget: stage i gets share[i] of the whole.
    now, remaining = 0.0, 100 * MS
    for stage in Stage:
        b = stage_budget_s(shares, stage, remaining - now)
        assert b == pytest.approx(shares[stage] * remaining)
        now += b
    # L0 finishes after 2 ms of its 10: the 8 ms left over go to L1..L3 in 2:3:4.
    l1 = stage_budget_s(shares, Stage.L1, 98 * MS)
    assert l1 == pytest.approx(98 * MS * 0.2 / 0.9) and l1 > 20 * MS
    assert l1 - 20 * MS == pytest.approx(8 * MS * 0.2 / 0.9)
    # An overrun takes from the later stages: L0 took 50 ms.
    late = stage_budget_s(shares, Stage.L1, 50 * MS)
    assert late == pytest.approx(50 * MS * 0.2 / 0.9) and late < 20 * MS
    # The planner applies the rule from its own clock readings.
    planner = StagePlanner(cfg, models={s: exact_model(0.0, 0.0) for s in Stage})
    budget = planner.open(deadline_s=10.0 + 100 * MS, now_s=10.0)
    assert planner.plan(budget, Stage.L0, 100, now_s=10.0).budget_s == pytest.approx(10 * MS)
    assert planner.plan(budget, Stage.L1, 100, now_s=10.0 + 2 * MS).budget_s == pytest.approx(l1)


def test_no_stage_is_planned_past_deadline_minus_reply_margin() -> None:
    cfg = CascadeConfig(reply_margin_ms=5.0)
    rng = np.random.default_rng(2)
    for _ in range(200):
        planner = StagePlanner(cfg, models={s: exact_model(0.2 * MS, 2 * US) for s in Stage})
        start = float(rng.uniform(0, 100))
        deadline = start + float(rng.uniform(0.1, 60)) * MS
        budget = planner.open(deadline, start)
        assert budget.reply_by_s == pytest.approx(deadline - 5 * MS)
        now = start
        for stage in Stage:
            d = planner.plan(budget, stage, int(rng.integers(0, 5000)), now)
            assert d.deadline_s <= max(budget.reply_by_s, now) + 1e-12
            assert d.budget_s <= budget.remaining_s(now) + 1e-12
            assert d.n_run == 0 or budget.remaining_s(now) > 0
            now += float(rng.uniform(0, 1.5)) * max(d.budget_s, 1 * MS)  # stages may overrun
    # A deadline inside the margin leaves stages no time: every stage skips.
    planner = StagePlanner(cfg, models={s: exact_model(0.0, 0.0) for s in Stage})
    budget = planner.open(deadline_s=1.004, now_s=1.0)
    assert [planner.plan(budget, s, 100, 1.0).kind for s in Stage] == [DecisionKind.SKIP] * 4


def test_deadline_already_past_and_no_deadline() -> None:
    cfg = CascadeConfig(default_deadline_ms=80.0, reply_margin_ms=3.0)
    with pytest.raises(DeadlineExceeded, match=r"deadline passed 2\.0 ms before the cascade started; no stage ran"):
        RequestBudget.open(cfg, deadline_s=0.998, now_s=1.0)
    with pytest.raises(DeadlineExceeded):
        RequestBudget.open(cfg, deadline_s=1.0, now_s=1.0)
    b = RequestBudget.open(cfg, deadline_s=math.inf, now_s=1.0)  # no deadline: the default
    assert b.deadline_s == pytest.approx(1.080) and b.remaining_s(1.0) == pytest.approx(0.077)


def test_a_stage_skipped_for_budget_is_probed_then_learns() -> None:
    cfg = CascadeConfig(probe_after_skips=3, reply_margin_ms=0.0, budget_shares=(0.0, 0.0, 0.0, 1.0))
    stale = exact_model(50 * MS, 100 * US)  # estimate from a slow spell; truly 1 ms now
    planner = StagePlanner(cfg, models={Stage.L3: stale})
    kinds = []
    for i in range(4):
        budget = planner.open(deadline_s=i + 10 * MS, now_s=float(i))
        kinds.append(planner.plan(budget, Stage.L3, 100, now_s=float(i), min_n=5))
    assert [d.kind for d in kinds[:3]] == [DecisionKind.SKIP] * 3
    probe = kinds[3]
    assert (probe.kind, probe.n_run, probe.probe) == (DecisionKind.SHRINK, 5, True)
    assert probe.deadline_s == pytest.approx(3 + 10 * MS)  # still bounded by the stage's budget
    before = stale.fixed_s
    report = planner.finish(probe, 1 * MS, out_count=100)
    assert stale.fixed_s < before and report.coverage == pytest.approx(5 / 100)
    # The skip count restarted: the next plan is a skip again, not another probe.
    budget = planner.open(deadline_s=9 + 10 * MS, now_s=9.0)
    assert planner.plan(budget, Stage.L3, 100, now_s=9.0, min_n=5).kind is DecisionKind.SKIP
    # probe_after_skips = 0 never probes.
    never = StagePlanner(dataclasses.replace(cfg, probe_after_skips=0), models={Stage.L3: exact_model(50 * MS, 100 * US)})
    for i in range(10):
        budget = never.open(deadline_s=i + 10 * MS, now_s=float(i))
        assert never.plan(budget, Stage.L3, 100, now_s=float(i)).kind is DecisionKind.SKIP


# ----------------------------------------------------------------------------- sizes and k


def test_stage_sizes_scale_table_28_to_the_catalog() -> None:
    cfg = CascadeConfig(l1_out=1_000)  # Table 28's sizes (the default l1_out is 2,000, see CascadeConfig)
    assert dataclasses.astuple(stage_sizes_for(cfg, 1_000_000)) == (10_000, 1_000, 100, 10)
    assert dataclasses.astuple(stage_sizes_for(cfg, 200_000)) == (2_000, 1_000, 100, 10)
    assert dataclasses.astuple(stage_sizes_for(cfg, 500)) == (500, 500, 100, 10)
    assert dataclasses.astuple(stage_sizes_for(cfg, 50)) == (50, 50, 50, 10)
    assert dataclasses.astuple(stage_sizes_for(cfg, 1_000_000, k=300)) == (10_000, 1_000, 300, 300)
    assert dataclasses.astuple(stage_sizes_for(dataclasses.replace(cfg, l0_out=4_000), 1_000_000)) == (4_000, 1_000, 100, 10)
    assert stage_sizes_for(cfg, 1_000_000).out(Stage.L1) == 1_000


@pytest.mark.parametrize(
    "k, items, message",
    [
        (-1, 1000, "k = -1 is invalid: use 0 (the default, 10) or 1..1,000"),
        (1001, 5000, "k = 1,001 is invalid: it exceeds cascade.max_k = 1,000"),
        (600, 500, "k = 600 is invalid: the catalog has 500 items"),
    ],
)
def test_bad_k_is_invalid_argument_naming_the_value(k: int, items: int, message: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        resolve_k(CascadeConfig(), k, items)
    assert message in str(info.value)


def test_k_zero_is_the_default() -> None:
    assert resolve_k(CascadeConfig(), 0, 1000) == 10
    assert resolve_k(CascadeConfig(), 0, 4) == 4  # a catalog smaller than the default k
    assert resolve_k(CascadeConfig(), 7, 1000) == 7


# ----------------------------------------------------------------------------- reports


def report(stage: str, intended: int, scored: int, reason: DegradedReason = DegradedReason.NONE) -> StageReport:
    return StageReport(stage, 10.0, 3.0, intended, min(intended, 50), intended, scored, reason)


def test_coverage_per_stage_and_overall() -> None:
    full = report("L0", 1000, 1000)
    half = report("L2", 100, 50, DegradedReason.LOOKUP_MISSING)
    skipped = report("L3", 100, 0, DegradedReason.SKIPPED_BUDGET)
    assert (full.coverage, half.coverage, skipped.coverage) == (1.0, 0.5, 0.0)
    assert report("L1", 0, 0).coverage == 1.0  # nothing intended: nothing missed
    assert overall_coverage([full, full, half, skipped]) == pytest.approx((1 + 1 + 0.5 + 0) / 4)
    assert overall_coverage([full, full, half, skipped], weights=(0.15, 0.15, 0.45, 0.25)) == pytest.approx(0.3 + 0.225)
    assert overall_coverage([]) == 0.0
    s = summarize([full, half, skipped])
    assert (s.degraded, s.degraded_reason) == (True, DegradedReason.LOOKUP_MISSING)  # the first degraded stage
    assert summarize([full, full]) .degraded is False and summarize([full]).degraded_reason is DegradedReason.NONE
    cold = summarize([full, skipped], cold_start=True)
    assert (cold.degraded, cold.degraded_reason) == (True, DegradedReason.COLD_START)
    with pytest.raises(Exception, match="scored = 5 is outside 0..intended"):
        StageReport("L1", 1.0, 1.0, 4, 4, 4, 5)


def test_finish_builds_the_report_and_to_proto_fills_the_wire_message() -> None:
    cfg = CascadeConfig(reply_margin_ms=0.0, budget_shares=(0.0, 0.0, 1.0, 0.0))
    m = exact_model(1 * MS, 10 * US)
    planner = StagePlanner(cfg, models={Stage.L2: m})
    budget = planner.open(deadline_s=6 * MS, now_s=0.0)
    d = planner.plan(budget, Stage.L2, 1000, now_s=0.0)
    assert d.kind is DecisionKind.SHRINK
    count = m.count
    # Shrunk and then 20 of the scored candidates missed their lookups: the fault is the reason.
    r = planner.finish(d, 4 * MS, out_count=100, scored=d.n_run - 20, reason=DegradedReason.LOOKUP_MISSING)
    assert m.count == count + 1  # the measurement went into the model
    assert (r.stage, r.in_count, r.out_count, r.degraded, r.degraded_reason) == ("L2", 1000, 100, True, DegradedReason.LOOKUP_MISSING)
    assert r.coverage == pytest.approx((d.n_run - 20) / 1000)
    p = to_proto(r)
    assert (p.stage, p.in_count, p.out_count, p.degraded, p.degraded_reason) == ("L2", 1000, 100, True, "lookup_missing")
    assert p.budget_ms == pytest.approx(6.0) and p.elapsed_ms == pytest.approx(4.0) and p.coverage == pytest.approx(r.coverage)
    # A skip: nothing observed, the input passes through, coverage 0.
    budget = planner.open(deadline_s=1.0 + 0.5 * MS, now_s=1.0)
    skip = planner.plan(budget, Stage.L2, 1000, now_s=1.0)
    sr = planner.finish(skip, 0.0, out_count=1000)
    assert m.count == count + 1
    assert (sr.degraded_reason, sr.coverage, sr.out_count) == (DegradedReason.SKIPPED_BUDGET, 0.0, 1000)
    assert to_proto(sr).degraded_reason == "skipped_budget" and sr.to_proto() == to_proto(sr)


def test_only_runs_that_measured_their_cost_teach_the_model() -> None:
    cfg = CascadeConfig(reply_margin_ms=0.0, budget_shares=(0.0, 0.0, 1.0, 0.0))
    m = exact_model(1 * MS, 10 * US)
    planner = StagePlanner(cfg, models={Stage.L2: m})

    def run(elapsed_s: float, **kw: object) -> int:
        budget = planner.open(deadline_s=20 * MS, now_s=0.0)
        d = planner.plan(budget, Stage.L2, 1000, now_s=0.0)
        assert d.kind is DecisionKind.RUN and d.budget_s == pytest.approx(20 * MS)
        before = m.count
        planner.finish(d, elapsed_s, out_count=100, **kw)  # type: ignore[arg-type]
        return m.count - before

    # A ranker that refused at once: no cost measured (it would make L2 look cheap).
    assert run(0.1 * MS, scored=0, reason=DegradedReason.TIMEOUT) == 0
    # Cut off at its deadline: a lower bound on its cost, which is learnt.
    assert run(20 * MS, scored=0, reason=DegradedReason.TIMEOUT) == 1
    # Ran but every lookup missed: the cost is real.
    assert run(9 * MS, scored=0, reason=DegradedReason.LOOKUP_MISSING) == 1
    # Scored nothing (no user vector to search with): nothing measured.
    assert run(0.05 * MS, scored=0, reason=DegradedReason.COLD_START) == 0
    assert run(9 * MS) == 1
    assert run(9 * MS, observe=False) == 0 and run(0.05 * MS, scored=0, observe=True) == 1
