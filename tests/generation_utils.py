"""Test helpers for the decode engine: a tiny random-init model, small configs, and a
fake-clock harness that drives the scheduler core and the engine step by step, checking
the policy's plan before every step (token budget, chunk size, no victim readmitted in
the step that preempted it) and the KV pool's books after it (per-block refcounts equal
the block tables holding each block; free, evictable and referenced blocks partition the
pool; only fully computed blocks are published)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator

import numpy as np
import torch

from generation.config import ContinuousBatchConfig, GenerationConfig, KvCacheConfig, ModelConfig
from generation.engine import DecodeEngine, build, run_step
from generation.model import TinyDecoder
from generation.oracle import generate_recompute
from generation.kv_cache import PagedKvCache
from generation.policy import ContinuousBatchPolicy, PagedPolicy
from generation.types import GenerationRequest
from recserve.scheduling import AdmissionConfig, Batch, Handle, Outcome, Priority, Scheduler
from tests.utils import Recorder


def one_torch_thread() -> Iterator[None]:
    """Fixture body: torch on one intra-op thread while a test runs. The tiny model's ops
    take microseconds; with 2 cores shared by other processes, thread hand-offs made the
    oracle tests ~10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tiny_config(
    *, num_blocks: int = 64, block_tokens: int = 4, max_seqs: int = 8, token_budget: int = 32, chunk: int | None = 8,
    dtype: str = "float64", sharing: bool = True, version: str = "v0", max_seq_len: int = 128,
) -> GenerationConfig:
    return GenerationConfig(
        model=ModelConfig(n_layers=2, n_heads=2, dim=16, max_seq_len=max_seq_len, dtype=dtype),
        batching=ContinuousBatchConfig(
            kv=KvCacheConfig(num_blocks=num_blocks, block_tokens=block_tokens, model_version=version, prefix_sharing=sharing),
            max_seqs=max_seqs, token_budget=token_budget, prefill_chunk_tokens=chunk,
        ),
        device="cpu",
    )


_MODELS: dict[tuple[Any, ...], TinyDecoder] = {}


def tiny_model(cfg: GenerationConfig, seed: int = 0) -> TinyDecoder:
    """Random weights, large enough (std 0.3) that greedy outputs depend on the context."""
    key = (cfg.model, seed)
    if key not in _MODELS:
        torch.manual_seed(seed)
        _MODELS[key] = TinyDecoder(cfg.model, init_std=0.3).eval()
    return _MODELS[key]


def random_prompt(rng: np.random.Generator, length: int) -> np.ndarray:
    return rng.integers(0, 256, size=length).astype(np.int64)


class CheckedEngine(DecodeEngine):
    """The engine, checking the policy's plan of each step before running it."""

    def __init__(self, model: TinyDecoder, cache: PagedKvCache, policy: PagedPolicy) -> None:
        super().__init__(model, cache)
        self.policy = policy

    def run_batch(self, batch: Batch) -> list[Outcome]:
        planned = [h.policy_data.step_tokens for h in batch.handles]
        for h in batch.handles:  # a preempted handle is re-queued at ``now``; steps counts its runs
            assert not (h.steps > 1 and h.enqueued_at == batch.started_at), f"{h.request_id} readmitted in the step that preempted it"
        if isinstance(self.policy, ContinuousBatchPolicy):
            cfg = self.policy.config
            if cfg.prefill_chunk_tokens is not None:
                assert sum(planned) <= cfg.token_budget and max(planned) <= cfg.prefill_chunk_tokens, planned
            else:  # unchunked: only the step's first prefill may go over the budget
                assert sum(planned) - max(planned) <= cfg.token_budget, planned
        return super().run_batch(batch)


class DecodeHarness:
    """Scheduler + engine on a fake clock (``now`` advances 10 ms per step)."""

    def __init__(self, cfg: GenerationConfig, *, model: TinyDecoder | None = None, admission: AdmissionConfig = AdmissionConfig(),
                 policy: PagedPolicy | None = None) -> None:
        self.cfg = cfg
        self.model = model if model is not None else tiny_model(cfg)
        sched, engine = build(cfg, self.model, admission=admission)
        if policy is not None:
            sched = Scheduler(policy, admission)
        self.policy: PagedPolicy = sched.policy  # type: ignore[assignment]
        self.engine: DecodeEngine = CheckedEngine(engine.model, engine.cache, self.policy)
        padding = getattr(self.policy, "padding_rows", None)
        if padding is not None:
            self.engine.padding = padding
        self.sched: Scheduler = sched
        self.rec = Recorder()
        self.now = 0.0
        self.handles: dict[str, Handle] = {}
        self.requests: dict[str, GenerationRequest] = {}
        self.batches: list[list[str]] = []

    def add(self, rid: str, request: GenerationRequest, *, tenant: str = "t", priority: Priority = Priority.STANDARD,
            deadline: float = math.inf) -> Handle:
        self.requests[rid] = request
        item = self.engine.item(rid, request, tenant=tenant, priority=priority, deadline=deadline)
        handle = self.handles[rid] = self.sched.add(item, self.now, self.rec)
        return handle

    def step(self) -> list[str]:
        batch = run_step(self.sched, self.engine, self.now, done_at=self.now + 0.01)
        self.now += 0.01
        self.check_blocks()
        ids = [] if batch is None else [h.request_id for h in batch.handles]
        self.batches.append(ids)
        return ids

    def run(self, max_steps: int = 10_000) -> int:
        steps = 0
        while not self.sched.idle:
            assert steps < max_steps, "the engine did not drain"
            assert self.step(), "work is pending but the policy formed no step"
            steps += 1
        return steps

    def check_blocks(self) -> None:
        """Each block's refcount = the live block tables holding it; free, evictable and
        referenced blocks partition the pool; a published block is fully computed."""
        pool = self.policy.pool
        bt = self.cfg.batching.kv.block_tokens
        held = [h.policy_data for h in self.handles.values() if h.policy_data is not None]
        assert all(not h.done for h in self.handles.values() if h.policy_data is not None)
        for t in held:  # taken from the cache, or computed by this sequence to the block's end
            assert t.registered <= max(t.prefix_hit_blocks, t.computed // bt), (t.registered, t.computed)
        held += getattr(self.policy, "_padding", [])  # the static baseline's padded rows
        assert self.policy.live == len(held)
        holders = np.bincount(np.array([b for t in held for b in t.blocks], dtype=np.int64), minlength=pool.num_blocks)
        assert holders.tolist() == pool.refcount.tolist()
        free, evictable = list(pool._free), list(pool._evictable)
        assert len(set(free)) == len(free) and not set(free) & set(evictable)
        assert set(free) | set(evictable) == set(np.flatnonzero(pool.refcount == 0).tolist())
        assert set(evictable) <= set(pool._key_of) and all(pool._key_of[b] == k for k, b in pool._by_key.items())

    def oracle(self, rid: str) -> np.ndarray:
        return generate_recompute(self.model, self.requests[rid])

    def assert_matches_oracle(self, rids: list[str] | None = None) -> None:
        for rid in rids if rids is not None else list(self.rec.done):
            got = np.asarray(self.rec.done[rid])
            want = self.oracle(rid)
            assert got.tolist() == want.tolist(), (rid, got.tolist(), want.tolist())
            partials = self.rec.partials.get(rid, [])
            assert partials == want[: len(want) - 1].tolist(), rid  # every token streamed once, in order


def with_kv(cfg: GenerationConfig, **changes: Any) -> GenerationConfig:
    """``cfg`` with KV pool fields replaced."""
    batching = dataclasses.replace(cfg.batching, kv=dataclasses.replace(cfg.batching.kv, **changes))
    return dataclasses.replace(cfg, batching=batching)
