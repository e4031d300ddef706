"""ranker.batch: a batch of requests as pairs over virtual users, checked against
features computed per request by hand with ranker.features (the oracle)."""

from __future__ import annotations

import numpy as np

from ranker.batch import Query, QueryKind, cross_bags, expand_rows, expand_user_side, interleave_jagged, layout, missing_per_request, pooled_features, request_features
from ranker.features import LogCounts, ServingArrays, Source, dense_features, sparse_features
from ranker.models.dlrm import DLRM_FEATURES
from ranker.models.l3 import l3_features
from recserve.catalog.storage import Csr


def counts(rng: np.random.Generator, n: int) -> np.ndarray:
    """[n, 2] (impressions, clicks <= impressions)."""
    imp = rng.integers(0, 30, n)
    return np.stack([imp, imp // 3], axis=1)


def arrays() -> ServingArrays:
    rng = np.random.default_rng(0)
    items, users, cats = 50, 6, 5
    hist_len = np.array([3, 0, 5, 2, 4, 1])
    tags_len = rng.integers(0, 3, items)
    return ServingArrays(
        item_category=rng.integers(0, cats, items),
        item_tags=Csr(rng.integers(0, 9, int(tags_len.sum())), np.concatenate(([0], np.cumsum(tags_len)))),
        user_history=Csr(rng.integers(0, items, int(hist_len.sum())), np.concatenate(([0], np.cumsum(hist_len)))),
        counts=LogCounts(item=counts(rng, items), user=counts(rng, users), category=counts(rng, cats), total=np.array([400, 40])),
    )


def q(user: int, cands: list[int], hist: list[int] = [], cold: bool = False) -> Query:
    return Query(QueryKind.RANK, "dlrm", user, cold, np.array(cands, np.int64), np.array(hist, np.int64))


def test_interleave_puts_each_rows_b_after_its_a() -> None:
    v, n = interleave_jagged(np.array([1, 2]), np.array([2, 0]), np.array([7, 8, 9]), np.array([1, 2]))
    assert v.tolist() == [1, 2, 7, 8, 9] and n.tolist() == [3, 2]


def test_a_batch_computes_what_each_request_alone_computes() -> None:
    a = arrays()
    queries = [q(0, [4, 9, 11]), q(2, [1], hist=[30, 31]), q(3, [5, 6]), q(8, [7, 8], hist=[2], cold=True)]
    lay = layout(a, queries)
    assert lay.pair_request.tolist() == [0, 0, 0, 1, 2, 2, 3, 3] and lay.first_pair.tolist() == [0, 3, 4, 6]
    # Oracle for request 1: user 2's history with [30, 31] appended, by hand.
    h = a.user_history
    hist2 = np.concatenate((np.asarray(h.values)[h.offsets[2] : h.offsets[3]], [30, 31]))
    assert lay.arrays.user_history.values[lay.arrays.user_history.offsets[1] : lay.arrays.user_history.offsets[2]].tolist() == hist2.tolist()
    # The cold user: no exported history, zero counts, only its own history.
    assert lay.arrays.user_history.lengths().tolist()[3] == 1 and lay.arrays.counts.user[3].tolist() == [0, 0]
    # Dense rows of known users without extra history equal the plain features.
    dense = dense_features(lay.arrays, lay.pair_request, lay.pair_items)
    np.testing.assert_array_equal(dense[:3], dense_features(a, np.zeros(3, np.int64), np.array([4, 9, 11])))
    np.testing.assert_array_equal(dense[4:6], dense_features(a, np.full(2, 3), np.array([5, 6])))


def test_user_side_bags_sit_at_each_requests_first_pair_and_expand_back() -> None:
    a = arrays()
    lay = layout(a, [q(0, [4, 9, 11]), q(5, [1, 2]), q(9, [3], cold=True)])
    plain = tuple(f for f in DLRM_FEATURES if f.source is not Source.CATEGORY_CROSS)
    keys, values, lengths = pooled_features(lay, plain, {f.name: f.name for f in plain})
    p = lay.num_pairs
    by_key = dict(zip(keys, lengths.reshape(len(keys), p)))
    assert by_key["dlrm_user_id"].tolist() == [1, 0, 0, 1, 0, 0]  # the cold user has no id row
    assert by_key["dlrm_history_items"].tolist() == [3, 0, 0, 1, 0, 0]
    assert by_key["dlrm_candidate_item"].tolist() == [1] * p
    # Per-pair candidate features equal the plain per-pair oracle.
    oracle = sparse_features(a, DLRM_FEATURES[1:2], np.array([0, 0, 0, 5, 5]), np.array([4, 9, 11, 1, 2]))
    assert oracle.lengths.tolist() == by_key["dlrm_candidate_item"][:5].tolist()
    assert expand_user_side(lay).tolist() == [0, 0, 0, 3, 3, 5]


def test_unpooled_history_rows_expand_to_every_pair_of_their_request() -> None:
    a = arrays()
    lay = layout(a, [q(0, [4, 9]), q(2, [1])])
    _, unpooled = l3_features(4)
    keys, values, lengths = request_features(lay, unpooled[:1], {f.name: f.name for f in unpooled})
    assert lengths.tolist() == [3, 4]  # user 2 has 5 history items, the window keeps the last 4
    idx = expand_rows(lengths, lay.pair_request)
    assert idx.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 6]
    assert values[idx[:3]].tolist() == values[:3].tolist()


def test_missing_bags_are_summed_per_request() -> None:
    lay = layout(arrays(), [q(0, [4, 9, 11]), q(2, [1]), q(3, [5, 6])])
    per_pair = {"a": np.array([1, 0, 2, 0, 0, 3]), "b": np.array([0, 0, 0, 4, 0, 0])}
    assert missing_per_request(lay, per_pair, per_pair=True).tolist() == [3, 4, 3]
    assert missing_per_request(lay, {"h": np.array([0, 2, 1])}, per_pair=False).tolist() == [0, 2, 1]


def test_crossed_bags_pool_to_the_per_pair_mean_of_the_oracle() -> None:
    """The crossed feature looked up once per request and pooled with weights equals the
    plain per-pair bag (every history item crossed with the candidate) mean-pooled."""
    import torch
    import torch.nn.functional as F

    a = arrays()
    queries = [q(0, [4, 9, 11, 4]), q(1, [3]), q(2, [1, 2], hist=[7, 7]), q(9, [5], cold=True), q(4, [6, 8])]
    lay = layout(a, queries)
    cross = next(f for f in DLRM_FEATURES if f.source is Source.CATEGORY_CROSS)
    c = a.num_categories
    table = torch.from_numpy(np.random.default_rng(5).standard_normal((c * c, 4)).astype(np.float32))
    oracle = sparse_features(lay.arrays, (cross,), lay.pair_request, lay.pair_items)
    want = F.embedding_bag(torch.from_numpy(oracle.values), table, torch.from_numpy(np.cumsum(oracle.lengths) - oracle.lengths), mode="mean")
    bags = cross_bags(lay, cross)
    assert bags.id_lengths.shape == (5,) and bags.ids.shape[0] < oracle.values.shape[0]  # fewer ids than the per-pair bags
    starts = np.cumsum(bags.id_lengths) - bags.id_lengths
    for r in range(5):  # each request's ids are distinct
        mine = bags.ids[starts[r] : starts[r] + bags.id_lengths[r]]
        assert np.unique(mine).shape == mine.shape
    rows = table[torch.from_numpy(bags.ids)]  # what the unpooled lookup returns, in input order
    got = F.embedding_bag(torch.from_numpy(bags.index), rows, torch.from_numpy(np.cumsum(bags.bag_lengths) - bags.bag_lengths), mode="sum",
                          per_sample_weights=torch.from_numpy(bags.weights))  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert float(got[lay.first_pair[3]].abs().sum()) == 0.0  # the cold user without history: an empty bag


def test_an_idle_ranker_dispatches_at_once_and_a_busy_one_waits_its_window() -> None:
    """IdleDispatchPolicy (fake clock): with no batch running, a lone request leaves at
    once instead of waiting max_wait_ms for company; while a batch runs, later arrivals
    wait the window and leave together."""
    from recserve.scheduling import Done, DynamicBatchConfig, Priority, Scheduler, WorkItem
    from ranker.service import IdleDispatchPolicy

    def item(name: str) -> WorkItem:
        return WorkItem(name, "t", Priority.STANDARD, 1e6, 500.0, None)

    sched = Scheduler(IdleDispatchPolicy(DynamicBatchConfig(max_batch_cost=8192, max_wait_ms=5.0, adaptive=False, dispatch_margin_ms=0.0)))
    sched.add(item("a"), 1.000)
    assert sched.next_wakeup(1.000) == 1.000
    first = sched.schedule(1.000)
    assert first is not None and len(first) == 1
    sched.add(item("b"), 1.001)  # the first batch still runs: the window applies
    sched.add(item("c"), 1.002)
    assert sched.schedule(1.002) is None
    second = sched.schedule(1.006)
    assert second is not None and len(second) == 2
    sched.complete(first, [Done(None)], 1.007)
    sched.complete(second, [Done(None)] * 2, 1.008)
    sched.add(item("d"), 1.020)  # idle again
    third = sched.schedule(1.020)
    assert third is not None and len(third) == 1
