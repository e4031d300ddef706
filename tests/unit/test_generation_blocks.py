"""The paged KV bookkeeping: allocation, refcounts, copy-on-write, the prefix cache and
its isolation (tenant, model version). Pure Python except the end-to-end isolation test,
which runs the tiny model and checks outputs against full recompute."""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pytest

from generation.blocks import BlockPool, BlockTable, prefix_keys
from generation.types import GenerationRequest
from recserve.errors import ResourceExhausted
from tests.generation_utils import DecodeHarness, one_torch_thread, random_prompt, tiny_config, tiny_model, with_kv


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    yield from one_torch_thread()


def test_allocate_release_and_exhaustion() -> None:
    pool = BlockPool(3)
    table = BlockTable(blocks=[pool.allocate(), pool.allocate(), pool.allocate()])
    assert sorted(table.blocks) == [0, 1, 2] and pool.free_count == 0
    with pytest.raises(ResourceExhausted, match="3 blocks"):
        pool.allocate()
    pool.release(table)
    assert pool.free_count == 3 and table.blocks == [] and int(pool.refcount.sum()) == 0


def test_keys_chain_every_earlier_token_and_start_from_tenant_and_version() -> None:
    tokens = np.arange(12, dtype=np.int64)
    a = prefix_keys("t1", "v0", tokens, 4)
    assert len(a) == 3 and len(set(a)) == 3
    changed = tokens.copy()
    changed[0] = 99  # first block differs: every later key differs too
    assert not set(prefix_keys("t1", "v0", changed, 4)) & set(a)
    assert not set(prefix_keys("t2", "v0", tokens, 4)) & set(a)
    assert not set(prefix_keys("t1", "v1", tokens, 4)) & set(a)
    assert prefix_keys("t1", "v0", tokens[:11], 4) == a[:2]  # only full blocks
    # No ambiguity from concatenating tenant and version.
    assert prefix_keys("a", "bv0", tokens, 4)[0] != prefix_keys("ab", "v0", tokens, 4)[0]


def test_shared_blocks_are_refcounted_and_cached_blocks_are_evicted_last() -> None:
    pool = BlockPool(4)
    keys = prefix_keys("t", "v0", np.arange(8, dtype=np.int64), 4)
    owner = BlockTable(blocks=[pool.allocate(), pool.allocate()])
    for key, block in zip(keys, owner.blocks):
        pool.register(key, block)
    other = BlockTable(blocks=pool.match(keys))
    assert other.blocks == owner.blocks and pool.refcount[owner.blocks].tolist() == [2, 2]
    assert all(pool.is_shared(b) for b in owner.blocks)
    pool.release(owner)
    pool.release(other)
    assert pool.free_count == 4 and pool.cached_count == 2  # unreferenced but still cached
    fresh = [pool.allocate(), pool.allocate()]  # the never-cached blocks go first
    assert not set(fresh) & set(other.blocks) and pool.cached_count == 2
    assert pool.peek_match(keys) == (2, 2)
    pool.allocate()  # now the oldest cached block is evicted
    assert pool.evictions == 1 and pool.peek_match(keys) == (0, 0)


def test_copy_on_write_gives_a_private_block_and_leaves_the_shared_one() -> None:
    pool = BlockPool(4)
    key = prefix_keys("t", "v0", np.arange(4, dtype=np.int64), 4)[0]
    shared = pool.allocate()
    pool.register(key, shared)
    table = BlockTable(blocks=pool.match([key]))
    pool.make_private(table, 0)
    assert table.blocks[0] != shared and table.copies == [(shared, table.blocks[0])]
    assert pool.refcount[shared] == 1 and pool.peek_match([key]) == (1, 0)  # still cached for others


def test_prefixes_are_never_shared_across_tenants_or_model_versions() -> None:
    cfg = tiny_config(num_blocks=64, block_tokens=4)
    h = DecodeHarness(cfg)
    prompt = random_prompt(np.random.default_rng(0), 14)  # 3 full blocks
    h.add("a1", GenerationRequest(prompt, max_new_tokens=4), tenant="acme")
    h.run()
    a1_blocks = set(h.policy.pool._by_key.values())
    h.add("b1", GenerationRequest(prompt.copy(), max_new_tokens=4), tenant="bravo")
    h.step()
    b1 = h.handles["b1"].policy_data
    assert b1.prefix_hit_blocks == 0 and not set(b1.blocks) & a1_blocks  # same text, other tenant: nothing shared
    h.run()
    h.add("a2", GenerationRequest(prompt.copy(), max_new_tokens=4), tenant="acme")
    h.step()
    assert h.handles["a2"].policy_data.prefix_hit_blocks == 3  # same tenant: shared
    h.run()
    h.assert_matches_oracle()

    # New weights (another model version) reuse nothing, even from a pool holding the v0 blocks.
    h2 = DecodeHarness(with_kv(cfg, model_version="v1"), model=tiny_model(cfg))
    h2.policy.pool = h.policy.pool
    assert h.policy.pool.cached_count >= 3
    h2.add("a3", GenerationRequest(prompt.copy(), max_new_tokens=2), tenant="acme")
    h2.step()
    assert h2.handles["a3"].policy_data.prefix_hit_blocks == 0
