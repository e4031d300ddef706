"""ranker.batch: a batch of requests as pairs over virtual users, checked against
features computed per request by hand with ranker.features (the oracle)."""

from __future__ import annotations

import numpy as np

from ranker.batch import Query, QueryKind, expand_rows, expand_user_side, interleave_jagged, layout, missing_per_request, pooled_features, request_features
from ranker.features import LogCounts, ServingArrays, dense_features, sparse_features
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
    keys, values, lengths = pooled_features(lay, DLRM_FEATURES, {f.name: f.name for f in DLRM_FEATURES})
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
