"""ContinuousBatchPolicy and the static baseline as scheduling policies: admission
limits, slots freed at once, the per-request token budget, fixed membership of static
batches, and the refusal of requests that can never fit. Fake clock, tiny model."""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pytest

from generation.policy import ContinuousBatchPolicy, register
from generation.static_policy import StaticBatchPolicy
from generation.types import GenerationRequest
from recserve.errors import InvalidArgument
from recserve.scheduling import PolicyKind, make_policy
from tests.generation_utils import DecodeHarness, one_torch_thread, random_prompt, tiny_config


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    yield from one_torch_thread()


def test_the_policy_is_registered_as_the_continuous_kind() -> None:
    register()
    policy = make_policy(PolicyKind.CONTINUOUS, tiny_config().batching)
    assert isinstance(policy, ContinuousBatchPolicy)


def test_a_request_that_can_never_fit_is_refused_at_add() -> None:
    h = DecodeHarness(tiny_config(num_blocks=8, block_tokens=4, max_seq_len=128))  # 32 tokens
    with pytest.raises(InvalidArgument, match="need 9 KV blocks of 4; the pool has 8"):
        h.add("big", GenerationRequest(random_prompt(np.random.default_rng(0), 20), max_new_tokens=13))
    with pytest.raises(InvalidArgument, match="exceeds the model's 128 positions"):
        h.add("long", GenerationRequest(random_prompt(np.random.default_rng(0), 100), max_new_tokens=29))
    assert h.sched.stats().drops["rejected"] == 1 and h.sched.idle


def test_a_finished_sequence_frees_its_slot_for_the_very_next_step() -> None:
    h = DecodeHarness(tiny_config(max_seqs=2))
    rng = np.random.default_rng(1)
    h.add("a", GenerationRequest(random_prompt(rng, 4), max_new_tokens=3))
    h.add("b", GenerationRequest(random_prompt(rng, 4), max_new_tokens=9))
    h.add("c", GenerationRequest(random_prompt(rng, 4), max_new_tokens=2))
    assert [h.step() for _ in range(4)] == [["a", "b"], ["a", "b"], ["a", "b"], ["b", "c"]]
    h.run()
    assert h.policy.peak_live == 2
    h.assert_matches_oracle()


def test_max_new_tokens_and_the_stop_token_end_generation() -> None:
    h = DecodeHarness(tiny_config())
    rng = np.random.default_rng(2)
    prompt = random_prompt(rng, 6)
    h.add("budget", GenerationRequest(prompt, max_new_tokens=7))
    h.run()
    full = h.rec.done["budget"]
    assert len(full) == 7
    stop = int(full[3])
    first = int(np.flatnonzero(full == stop)[0])
    h.add("stopped", GenerationRequest(prompt.copy(), max_new_tokens=7, stop_token=stop))
    h.run()
    assert h.rec.done["stopped"].tolist() == full[: first + 1].tolist()  # ends with the stop token
    h.assert_matches_oracle()


@pytest.mark.parametrize("padded", [True, False])
def test_static_batches_keep_their_membership_until_the_longest_finishes(padded: bool) -> None:
    cfg = tiny_config(num_blocks=64, block_tokens=4, max_seqs=3)
    policy = StaticBatchPolicy(cfg.batching, padded=padded)
    h = DecodeHarness(cfg, policy=policy)
    rng = np.random.default_rng(3)
    lengths = {"a": 2, "b": 6, "c": 3, "d": 2, "e": 4}
    for rid, n in lengths.items():
        h.add(rid, GenerationRequest(random_prompt(rng, 5), max_new_tokens=8, stop_after=n))
    h.step()
    # Each member reserves prompt + max_new_tokens (13 tokens: 4 blocks) up front.
    assert policy.pool.used_count == 3 * 4
    h.step()  # a finished: padded, its slot and reservation stay; unpadded, they come back
    assert policy.pool.used_count == (3 * 4 if padded else 2 * 4)
    assert len(policy.padding_rows()) == (1 if padded else 0)
    computed = h.engine.tokens_computed
    h.step()
    assert h.engine.tokens_computed - computed == (3 if padded else 2)  # the padded row is computed too
    h.run()
    assert h.batches[:6] == [["a", "b", "c"], ["a", "b", "c"], ["b", "c"], ["b"], ["b"], ["b"]]
    assert h.batches[6] == ["d", "e"]  # admitted only when b, the longest, finished
    assert {rid: len(out) for rid, out in h.rec.done.items()} == lengths
    h.assert_matches_oracle()
    assert policy.pool.used_count == 0 and policy.live == 0
