"""One scheduler core, three workloads: ranker batches (DynamicBatchPolicy), lookup
windows (FeatureParallelPolicy) and LLM decode (ContinuousBatchPolicy), each built by
``make_policy`` from its PolicyKind and driven by the same ``Scheduler`` class on one
fake clock, with their traffic interleaved. Oracles: the ranker's and lookup's answers
computed without a scheduler, full-recompute decoding for the decode sequences."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import pytest

from generation import policy as decode_policy
from generation.engine import DecodeEngine
from generation.kv_cache import PagedKvCache
from generation.types import GenerationRequest
from recserve.scheduling import (
    Batch, Done, DynamicBatchConfig, FeatureParallelConfig, PolicyKind, Priority, Scheduler, WorkItem, make_policy,
)
from tests.generation_utils import DecodeHarness, one_torch_thread, random_prompt, tiny_config
from tests.utils import Recorder


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    yield from one_torch_thread()


def rank(batch: Batch) -> list[Any]:
    """The fake ranker: a score per candidate, sum of its features."""
    return [Done(np.asarray(p).sum(axis=1)) for p in batch.payloads]


def lookup(batch: Batch) -> list[Any]:
    """The fake lookup: all ids of the window at once (deduplicated), each caller's rows back."""
    ids = np.concatenate([np.asarray(p) for p in batch.payloads])
    uniq, inverse = np.unique(ids, return_inverse=True)
    rows = (uniq * 10)[inverse]
    bounds = np.cumsum([len(p) for p in batch.payloads])[:-1]
    return [Done(r) for r in np.split(rows, bounds)]


def test_ranker_lookup_and_decode_policies_run_on_the_same_core() -> None:
    cfg = tiny_config(num_blocks=24, block_tokens=4, max_seqs=4)
    decode_policy.register()
    policies = {
        "rank": make_policy(PolicyKind.DYNAMIC, DynamicBatchConfig(max_batch_cost=64, max_wait_ms=2.0)),
        "lookup": make_policy(PolicyKind.FEATURE_PARALLEL, FeatureParallelConfig(window_ms=4.0, max_cost=256)),
        "decode": make_policy(PolicyKind.CONTINUOUS, cfg.batching),
    }
    assert {type(p).__name__ for p in policies.values()} == {"DynamicBatchPolicy", "FeatureParallelPolicy", "ContinuousBatchPolicy"}
    scheds = {name: Scheduler(p) for name, p in policies.items()}
    assert {type(s) for s in scheds.values()} == {Scheduler}
    h = DecodeHarness(cfg)  # model + oracle
    engine = DecodeEngine(h.model, PagedKvCache(h.model.config, cfg.batching.kv, dtype=h.model.dtype, device=h.engine.device))
    runners = {"rank": rank, "lookup": lookup, "decode": engine.run_batch}
    rec = Recorder()
    rng = np.random.default_rng(0)
    expected: dict[str, Any] = {}
    requests: dict[str, GenerationRequest] = {}
    now = 0.0
    for tick in range(400):
        if tick < 200 and tick % 4 == 0:
            feats = rng.integers(0, 9, size=(int(rng.integers(1, 20)), 3))
            rid = f"rank{tick}"
            expected[rid] = feats.sum(axis=1)
            scheds["rank"].add(WorkItem(rid, "t", Priority.STANDARD, now + 1.0, float(len(feats)), feats), now, rec)
        if tick < 200 and tick % 3 == 0:
            ids = rng.integers(0, 50, size=int(rng.integers(1, 8)))
            rid = f"lookup{tick}"
            expected[rid] = ids * 10
            scheds["lookup"].add(WorkItem(rid, "t", Priority.STANDARD, now + 1.0, float(len(ids)), ids), now, rec)
        if tick < 100 and tick % 10 == 0:
            rid = f"gen{tick}"
            requests[rid] = GenerationRequest(random_prompt(rng, int(rng.integers(2, 14))), max_new_tokens=int(rng.integers(2, 12)))
            scheds["decode"].add(engine.item(rid, requests[rid]), now, rec)
        for name, sched in scheds.items():
            due = sched.next_wakeup(now)
            if due is not None and due <= now and (batch := sched.schedule(now)) is not None:
                sched.complete(batch, runners[name](batch), now + 0.0002)
        now += 0.0005
    assert all(s.idle for s in scheds.values())
    assert not rec.errors
    assert set(rec.done) == set(expected) | set(requests)
    for rid, want in expected.items():
        assert np.asarray(rec.done[rid]).tolist() == want.tolist(), rid
    h.requests.update(requests)
    h.rec = rec
    h.assert_matches_oracle(list(requests))
    assert scheds["rank"].stats().batch_size.max > 1 and scheds["lookup"].stats().batch_size.max > 1
    assert scheds["decode"].stats().batch_size.max > 1  # decode sequences were batched too
