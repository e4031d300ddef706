"""Cheap windows (issue 9): the common window's lean result path.

``resolve_callers`` builds the results of a single-table window of one-feature pooled
callers with nothing missing or not found through ``_single_feature_results``. On random
such windows (sum and mean tables, B = 1..3, empty bags) it must be taken, and give
bit for bit what the general per-caller loop gives from the same pooled pieces, which
must equal TorchRec's EmbeddingBagCollection; any other window (a row missing or not
found, a caller with two features, an unpooled caller) must take the general path.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from recserve.lookup import reassemble
from recserve.lookup.reassemble import resolve_callers
from recserve.lookup.types import CallerLookup, LookupResult
from tests.unit.test_reassemble_fast import DIMS, POOLING, ROWS, _arrive_window, _callers, _check_oracle, _ebc, _same


def _resolve(callers: list[CallerLookup], group: list[int], rng: np.random.Generator, *, partial_arrivals: bool = False) -> tuple[list[LookupResult], list[LookupResult], int]:
    """(results, the general loop's results from the same pieces, times the lean path
    ran) for ``group`` of a window whose rows arrived as ``_arrive_window`` makes them; every
    result is checked against the TorchRec oracle."""
    windows, asm, tables, nf, missing_rows = _arrive_window(rng, callers, partial_arrivals=partial_arrivals)
    lean = reassemble._single_feature_results
    general: list[LookupResult] = []
    calls = 0

    def spy(cs: Sequence[CallerLookup], g: Sequence[int], pieces: Sequence[torch.Tensor]) -> list[LookupResult]:
        nonlocal calls
        calls += 1
        (table,) = windows
        general.extend(reassemble._caller_results(cs, g, {table: pieces}, {}, None, pieces))
        return lean(cs, g, pieces)

    reassemble._single_feature_results = spy  # type: ignore[assignment]
    try:
        results = resolve_callers(callers, group, windows, asm, {t: POOLING[t] for t in windows})
    finally:
        reassemble._single_feature_results = lean  # type: ignore[assignment]
    ebc = _ebc({t: tables.get(t, np.zeros((ROWS[t], DIMS[t]), np.float32)) for t in ROWS})
    for c, res in zip(group, results):
        _check_oracle(callers[c], res, ebc, tables, nf, missing_rows)
    return results, general, calls


@pytest.mark.parametrize("key", ["item_id", "user_id"], ids=["sum", "mean"])
@pytest.mark.parametrize("seed", range(5))
def test_the_common_window_takes_the_lean_path_with_the_general_results(key: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    callers = _callers(rng, int(rng.integers(2, 12)), pooled=True, keys=[key])
    n = len(callers)
    for group in (list(range(n)), [int(c) for c in rng.permutation(n)[: max(1, n // 2)]], [n - 1]):
        results, general, calls = _resolve(callers, group, rng)
        assert calls == 1 and len(results) == len(general) == len(group)
        for a, b in zip(results, general):
            _same(a, b)
            assert a.missing_by_feature == {key: 0} and not a.missing_bags and not a.rows
        # Each caller its own result objects (nothing mutable shared between them).
        assert len({id(r.missing_by_feature) for r in results}) == len(results)
        assert len({id(r.pooled) for r in results}) == len(results)


@pytest.mark.parametrize("case", ["missing", "two-features", "unpooled", "two-tables"])
def test_any_other_window_takes_the_general_path(case: str) -> None:
    rng = np.random.default_rng(7)
    if case == "missing":
        callers = _callers(rng, 6, pooled=True, keys=["item_id"])
    elif case == "two-features":
        callers = _callers(rng, 5, pooled=True, keys=["item_id"]) + _callers(rng, 1, pooled=True, keys=["item_id", "hist"])
    elif case == "unpooled":
        callers = _callers(rng, 5, pooled=True, keys=["item_id"]) + _callers(rng, 1, pooled=False, keys=["item_id"])
    else:
        callers = _callers(rng, 5, pooled=True, keys=["item_id"]) + _callers(rng, 1, pooled=True, keys=["user_id"])
    _, _, calls = _resolve(callers, list(range(len(callers))), rng, partial_arrivals=case == "missing")
    assert calls == 0
