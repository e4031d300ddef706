"""The exactness oracle: greedy decoding through the paged, continuously batched path
gives exactly the tokens of naive full recompute (no KV cache, one sequence at a time,
the same weights), in float64 so near-ties cannot flake. Covers mixed lengths, forced
preemption, shared prefixes (with copy-on-write), chunked and unchunked prefill and
cancellation in the middle of a batch, and seeded random mixes of all of these with
deadlines and priorities; plus one sequence failing on a NaN while the others finish
(the NaN reaches neither padded neighbours nor later requests through the prefix cache),
and expiry freeing blocks at the next step. Fake clock, tiny model."""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np
import pytest

from generation.oracle import generate_recompute
from generation.types import GenerationRequest
from recserve.scheduling import ItemStatus, Priority
from tests.generation_utils import DecodeHarness, one_torch_thread, random_prompt, tiny_config


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    yield from one_torch_thread()


def add_mixed(h: DecodeHarness, rng: np.random.Generator, n: int, *, prompt: tuple[int, int] = (1, 30), new: tuple[int, int] = (1, 20)) -> None:
    for i in range(n):
        p = random_prompt(rng, int(rng.integers(*prompt)))
        h.add(f"r{i}", GenerationRequest(p, max_new_tokens=int(rng.integers(*new))))


def test_the_oracle_is_not_trivial() -> None:
    # Different prompts give different continuations; a model that ignored its context
    # (or a cache bug that read the wrong sequence) would not be caught otherwise.
    h = DecodeHarness(tiny_config())
    rng = np.random.default_rng(1)
    outs = {tuple(generate_recompute(h.model, GenerationRequest(random_prompt(rng, 8), max_new_tokens=6)).tolist()) for _ in range(6)}
    assert len(outs) >= 5


@pytest.mark.parametrize("chunk", [3, 8, None])
def test_mixed_prompt_and_output_lengths_match_full_recompute(chunk: int | None) -> None:
    h = DecodeHarness(tiny_config(chunk=chunk, token_budget=24, num_blocks=128))
    add_mixed(h, np.random.default_rng(0), 12)
    h.run()
    assert len(h.rec.done) == 12 and not h.rec.errors
    h.assert_matches_oracle()
    assert max(len(b) for b in h.batches) > 1  # sequences really were batched together
    assert h.policy.pool.used_count == 0


def test_a_tiny_pool_forces_preemption_and_recompute_and_outputs_still_match() -> None:
    h = DecodeHarness(tiny_config(num_blocks=12, block_tokens=4, max_seqs=8))  # 48 tokens for 8 sequences
    add_mixed(h, np.random.default_rng(2), 10, prompt=(4, 16), new=(8, 24))
    h.run()
    assert h.policy.preemptions >= 3 and h.sched.stats().preempted >= 3
    assert len(h.rec.done) == 10
    h.assert_matches_oracle()  # includes: no token streamed twice after a recompute


def test_shared_prefixes_are_computed_once_and_outputs_match() -> None:
    h = DecodeHarness(tiny_config(num_blocks=96, block_tokens=4, chunk=8))
    rng = np.random.default_rng(3)
    system = random_prompt(rng, 16)  # 4 full blocks
    h.add("first", GenerationRequest(np.concatenate([system, random_prompt(rng, 3)]), max_new_tokens=5))
    h.step()
    h.step()  # its 19-token prompt is prefilled (chunks of 8, 8, 3): the 4 system blocks are registered
    for i in range(5):
        h.add(f"s{i}", GenerationRequest(np.concatenate([system, random_prompt(rng, int(rng.integers(1, 9)))]), max_new_tokens=6))
    h.run()
    assert h.policy.prefix_hit_blocks >= 5 * 4
    h.assert_matches_oracle()


def test_a_fully_cached_prompt_copies_its_last_block_on_write_and_matches() -> None:
    h = DecodeHarness(tiny_config(num_blocks=64, block_tokens=4))
    prompt = random_prompt(np.random.default_rng(4), 12)  # exactly 3 blocks
    h.add("a", GenerationRequest(prompt, max_new_tokens=4))
    h.run()
    h.add("b", GenerationRequest(prompt.copy(), max_new_tokens=7))
    h.add("c", GenerationRequest(prompt.copy(), max_new_tokens=3))
    h.run()
    # b and c reuse all 3 blocks; each recomputes token 11 for its logits, so each gets a
    # private copy of block 2 rather than writing into the shared one.
    assert h.policy.pool.cow_copies == 2
    h.assert_matches_oracle()
    assert h.rec.done["b"][:3].tolist() == h.rec.done["a"][:3].tolist()


def test_long_prompts_are_prefilled_in_chunks_within_the_token_budget() -> None:
    h = DecodeHarness(tiny_config(num_blocks=128, token_budget=10, chunk=6, max_seq_len=128))
    rng = np.random.default_rng(5)
    h.add("short", GenerationRequest(random_prompt(rng, 2), max_new_tokens=30))
    h.step()
    h.add("long", GenerationRequest(random_prompt(rng, 70), max_new_tokens=3))
    steps_with_both = 0
    while not h.sched.idle:
        batch = h.sched.schedule(h.now)
        assert batch is not None
        tokens = sum(x.policy_data.step_tokens for x in batch.handles)
        assert tokens <= 10  # the step budget
        assert all(x.policy_data.step_tokens <= 6 for x in batch.handles)  # the chunk
        steps_with_both += {x.request_id for x in batch.handles} == {"short", "long"}
        h.sched.complete(batch, h.engine.run_batch(batch), h.now)
        h.now += 0.01
    assert steps_with_both >= 70 // 6  # short kept decoding during long's whole prefill
    h.assert_matches_oracle()


def test_cancelling_in_the_middle_of_a_batch_frees_blocks_and_spares_the_others() -> None:
    h = DecodeHarness(tiny_config(num_blocks=64))
    add_mixed(h, np.random.default_rng(6), 6, prompt=(3, 10), new=(10, 20))
    for _ in range(3):
        h.step()
    batch = h.sched.schedule(h.now)
    assert batch is not None and len(batch) == 6
    victim = batch.handles[2]
    held = len(victim.policy_data.blocks)
    used = h.policy.pool.used_count
    assert h.sched.cancel(victim, h.now)  # while its step runs
    h.sched.complete(batch, h.engine.run_batch(batch), h.now)
    assert victim.policy_data is None and h.policy.pool.used_count <= used - held + 5  # its blocks came back
    queued_resident = h.sched.cancel(h.handles["r4"], h.now)  # a resident one: freed at once
    assert queued_resident and h.handles["r4"].policy_data is None
    h.run()
    gone = {victim.request_id, "r4"}
    assert set(h.rec.errors) == gone and all(type(e).__name__ == "Cancelled" for e in h.rec.errors.values())
    assert all(victim.request_id not in b and "r4" not in b for b in h.batches[4:])  # no zombie decoding
    h.assert_matches_oracle([r for r in h.requests if r not in gone])


def test_an_expired_sequence_frees_its_blocks_at_the_next_step() -> None:
    h = DecodeHarness(tiny_config(num_blocks=64))
    rng = np.random.default_rng(7)
    h.add("late", GenerationRequest(random_prompt(rng, 6), max_new_tokens=40), deadline=0.035)
    h.add("ok", GenerationRequest(random_prompt(rng, 6), max_new_tokens=8))
    for _ in range(4):
        h.step()  # t = 0.00 .. 0.03: before its deadline it decodes
    late = h.handles["late"]
    assert late.status is ItemStatus.RESIDENT and late.policy_data is not None
    h.step()  # t = 0.04: the core expires it before forming the step
    assert late.status is ItemStatus.DROPPED and late.policy_data is None
    assert h.batches[-1] == ["ok"]
    h.run()
    assert type(h.rec.errors["late"]).__name__ == "DeadlineExceeded"
    h.assert_matches_oracle(["ok"])


def test_a_sequence_with_nan_logits_fails_alone_and_the_batch_goes_on() -> None:
    h = DecodeHarness(tiny_config(num_blocks=64))
    add_mixed(h, np.random.default_rng(8), 4, prompt=(5, 12), new=(6, 12))
    h.step()
    h.step()
    bad = h.handles["r1"]
    block = bad.policy_data.blocks[0]
    bt = h.cfg.batching.kv.block_tokens
    h.engine.cache.kv[:, block * bt : (block + 1) * bt, 1] = float("nan")  # corrupt r1's cached V only
    h.run()
    assert set(h.rec.errors) == {"r1"} and "non-finite logits" in h.rec.errors["r1"].message
    assert bad.status is ItemStatus.FAILED and h.sched.stats().failed == 1
    h.assert_matches_oracle(["r0", "r2", "r3"])
    assert h.policy.pool.used_count == 0



def test_a_nan_in_block_zero_does_not_reach_the_padded_prefill_chunks_beside_it() -> None:
    # Padded key columns of a prefill group must read the never-written null slot: a
    # zero-filled block table would point them at physical block 0, and masked-out NaN
    # still poisons the softmax-weighted sum (0 * NaN).
    h = DecodeHarness(tiny_config(num_blocks=64, block_tokens=4, chunk=8))
    rng = np.random.default_rng(13)
    h.add("bad", GenerationRequest(random_prompt(rng, 5), max_new_tokens=20))
    h.step()
    assert h.handles["bad"].policy_data.blocks[0] == 0
    h.engine.cache.kv[:, 0:4, 1] = float("nan")  # physical block 0, V
    h.add("p_short", GenerationRequest(random_prompt(rng, 3), max_new_tokens=4))
    h.add("p_long", GenerationRequest(random_prompt(rng, 9), max_new_tokens=4))
    assert sorted(h.step()) == ["bad", "p_long", "p_short"]  # one step: two chunks of 3 and 8 tokens, padded
    h.run()
    assert set(h.rec.errors) == {"bad"}
    h.assert_matches_oracle(["p_short", "p_long"])

def test_priority_and_remaining_work_choose_the_victim() -> None:
    h = DecodeHarness(tiny_config(num_blocks=10, block_tokens=4, max_seqs=4, chunk=None, token_budget=64))
    rng = np.random.default_rng(9)
    h.add("crit", GenerationRequest(random_prompt(rng, 7), max_new_tokens=20), priority=Priority.CRITICAL)
    h.add("std_short", GenerationRequest(random_prompt(rng, 7), max_new_tokens=12))
    h.add("std_long", GenerationRequest(random_prompt(rng, 7), max_new_tokens=30))
    h.run()
    assert h.policy.preemptions >= 1
    crit_last = max(i for i, b in enumerate(h.batches) if "crit" in b)
    assert all("crit" in b for b in h.batches[: crit_last + 1])  # the critical one was never the victim
    first_out = next(i for i, b in enumerate(h.batches) if len(b) < 3)
    assert h.batches[first_out] == ["crit", "std_short"]  # same class: the most remaining work went first
    h.assert_matches_oracle()


def test_a_more_urgent_arrival_preempts_a_less_urgent_running_sequence() -> None:
    h = DecodeHarness(tiny_config(num_blocks=64, max_seqs=2))
    rng = np.random.default_rng(10)
    h.add("be_short", GenerationRequest(random_prompt(rng, 5), max_new_tokens=10), priority=Priority.BEST_EFFORT)
    h.add("be_long", GenerationRequest(random_prompt(rng, 5), max_new_tokens=25), priority=Priority.BEST_EFFORT)
    h.step()
    h.step()
    h.add("crit", GenerationRequest(random_prompt(rng, 5), max_new_tokens=6), priority=Priority.CRITICAL)
    assert sorted(h.step()) == ["be_short", "crit"]  # its slot came from the most remaining work
    assert h.handles["be_long"].status is ItemStatus.QUEUED and h.policy.preemptions == 1
    h.run()
    h.assert_matches_oracle()  # the victim resumed by recompute, no token twice


def test_a_victim_preempted_for_an_urgent_arrival_waits_a_step_before_it_is_readmitted() -> None:
    # The victim frees 7 blocks, the urgent arrival's first chunk takes 4: room is left,
    # but readmitting the victim in the same step would recompute it at once and take
    # back the room it was preempted for.
    h = DecodeHarness(tiny_config(num_blocks=10, block_tokens=4, max_seqs=4, chunk=16, token_budget=32))
    rng = np.random.default_rng(11)
    h.add("std", GenerationRequest(random_prompt(rng, 20), max_new_tokens=12))
    std = h.handles["std"]
    h.step()
    while len(std.policy_data.blocks) < 7:
        h.step()
    assert h.policy.pool.free_count == 3
    h.add("crit", GenerationRequest(random_prompt(rng, 16), max_new_tokens=4), priority=Priority.CRITICAL)
    assert h.step() == ["crit"]  # its 4-block chunk did not fit in 3: std was preempted for it
    assert h.policy.preemptions == 1 and std.status is ItemStatus.QUEUED
    h.run()
    assert set(h.rec.done) == {"std", "crit"}  # the victim resumed later, by recompute
    h.assert_matches_oracle()


def test_a_failed_sequence_s_cached_prefix_is_not_handed_to_later_requests() -> None:
    h = DecodeHarness(tiny_config(num_blocks=64, block_tokens=4, chunk=8))
    rng = np.random.default_rng(12)
    system = random_prompt(rng, 8)  # 2 full blocks, registered once prefilled
    h.add("bad", GenerationRequest(np.concatenate([system, random_prompt(rng, 3)]), max_new_tokens=6))
    h.step()  # the 8 system tokens: both blocks published in the prefix cache
    bad = h.handles["bad"].policy_data
    assert bad.registered == 2 and h.policy.pool.cached_count == 2
    bt = h.cfg.batching.kv.block_tokens
    block = bad.blocks[0]
    h.engine.cache.kv[:, block * bt : (block + 1) * bt, 1] = float("nan")  # a fault in a shared prefix block
    h.run()
    assert set(h.rec.errors) == {"bad"}
    h.add("next", GenerationRequest(np.concatenate([system, random_prompt(rng, 2)]), max_new_tokens=5))
    h.run()
    assert set(h.rec.errors) == {"bad"}  # next did not read the cached NaN
    assert h.policy.prefix_hit_blocks == 0  # it recomputed the system prompt
    h.assert_matches_oracle(["next"])
    assert h.policy.pool.cached_count == 2 and h.policy.pool.used_count == 0  # next's own blocks are cached now


@pytest.mark.parametrize("seed", [2, 3, 4, 14])
def test_random_mixes_of_sharing_preemption_cancels_and_deadlines_match_full_recompute(seed: int) -> None:
    # Everything at once on a small pool: two tenants sharing two system prompts,
    # staggered arrivals of three priority classes, cancels (queued, resident and in
    # flight) and deadlines. The harness checks the books and the plan at every step.
    rng = np.random.default_rng(seed)
    bt = int(rng.choice([2, 4]))
    chunk = [None, 3, 5][seed % 3]
    h = DecodeHarness(tiny_config(num_blocks=int(rng.integers(12, 24)), block_tokens=bt, max_seqs=6, token_budget=12, chunk=chunk))
    systems = [random_prompt(rng, 2 * bt + 1), random_prompt(rng, 3 * bt)]
    arrivals = np.sort(rng.integers(0, 20, size=12))
    cancelled: set[str] = set()
    expiring: set[str] = set()
    k = 0
    while k < len(arrivals) or not h.sched.idle:
        assert h.now < 20.0, "the engine did not drain"
        while k < len(arrivals) and arrivals[k] * 0.01 <= h.now + 1e-9:
            rid = f"r{k}"
            prompt = np.concatenate([systems[k % 2], random_prompt(rng, int(rng.integers(0, 5)))])  # 0: fully cached, CoW
            deadline = h.now + 0.06 if k % 5 == 4 else math.inf
            h.add(rid, GenerationRequest(prompt, max_new_tokens=int(rng.integers(2, 14))), tenant=("a", "b")[k % 3 == 0],
                  priority=Priority(k % 3), deadline=deadline)
            expiring |= {rid} if deadline < math.inf else set()
            k += 1
        if k % 4 == 3 and rng.random() < 0.1:  # a queued or resident one
            target = h.handles[f"r{int(rng.integers(0, k))}"]
            cancelled |= {target.request_id} if h.sched.cancel(target, h.now) else set()
        batch = h.sched.schedule(h.now)
        if batch is not None:
            if rng.random() < 0.05:  # one in flight
                target = batch.handles[int(rng.integers(0, len(batch)))]
                cancelled |= {target.request_id} if h.sched.cancel(target, h.now) else set()
            h.sched.complete(batch, h.engine.run_batch(batch), h.now + 0.01)
        h.now += 0.01
        h.check_blocks()
    assert cancelled <= set(h.rec.errors) <= cancelled | expiring
    assert all(type(h.rec.errors[r]).__name__ == "DeadlineExceeded" for r in set(h.rec.errors) - cancelled)
    assert len(h.rec.done) >= 6
    h.assert_matches_oracle()
    assert h.policy.preemptions > 0 and h.policy.prefix_hit_blocks > 0  # the mix exercised both
    assert h.policy.pool.used_count == 0
