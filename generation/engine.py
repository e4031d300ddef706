"""The decode engine: the batch runner of a continuous-batching scheduler.

:class:`DecodeEngine` runs one scheduler :class:`~recserve.scheduling.Batch` as one
model step and answers one outcome per sequence:

- ``Continue(partial_output=token, new_cost=tokens held)`` — a token was generated and
  streams to the caller; ``Continue()`` — a prefill chunk that has not reached the end;
- ``Done(generated)`` — [G] int64 tokens, at the stop token, ``max_new_tokens`` or
  ``stop_after``;
- ``Failed(InternalError)`` — this sequence's logits are not finite (a NaN); the rest of
  the batch goes on.

It reads what to compute from each handle's :class:`~generation.blocks.BlockTable`
(filled in by the policy's ``select``), builds the flat step with array operations (no
per-token Python), makes the policy's copy-on-write copies, then runs
:meth:`TinyDecoder.forward_paged`. The runner signature ``run_batch(batch) -> outcomes``
is what :class:`~recserve.scheduling.ServingLoop` takes (as an executor function).

:func:`build` assembles model, pool, policy and :class:`~recserve.scheduling.Scheduler`
from a :class:`GenerationConfig`; :func:`run_step` is the synchronous driver tests and
benchmarks use.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np
import torch

from recserve.errors import InternalError, InvalidArgument
from recserve.scheduling import (
    AdmissionConfig, Batch, Continue, Done, Failed, Handle, Outcome, Priority, Scheduler, WorkItem, make_policy,
    PolicyKind,
)

from generation import policy as policy_module
from generation.blocks import BlockTable
from generation.config import GenerationConfig
from generation.kv_cache import PagedKvCache
from generation.model import AttnGroup, DecodeGroup, PagedStep, TinyDecoder, resolve_device
from generation.types import GenerationRequest, SequenceState


_SEED_MASK = (1 << 64) - 1  # a negative int64 seed -> its two's-complement entropy


class DecodeEngine:
    """Runs continuous-batching steps of ``model`` over ``cache`` (see the module doc)."""

    def __init__(self, model: TinyDecoder, cache: PagedKvCache, *, padding: Callable[[], Sequence[BlockTable]] | None = None) -> None:
        """``padding`` (the static baseline only): block tables of finished members whose
        slot a fixed-width batch keeps computing; each step runs one discarded token for
        each, so static batching pays for its padded rows as a fixed-width kernel does."""
        self.model = model.eval()
        self.cache = cache
        self.padding = padding
        self.device = cache.kv.device
        self.block_tokens = cache.block_tokens
        self.max_seq_len = model.config.max_seq_len
        self.steps = 0
        self.tokens_computed = 0  # prompt + decode tokens through the model

    def item(
        self, request_id: str, request: GenerationRequest, *, tenant: str = "default",
        priority: Priority = Priority.STANDARD, deadline: float = math.inf,
    ) -> WorkItem:
        """The scheduler item for ``request``; cost = tokens held (the prompt, at first)."""
        total = request.prompt_len + request.max_new_tokens
        if total > self.max_seq_len:
            raise InvalidArgument(
                f"request {request_id}: prompt {request.prompt_len} + max_new_tokens {request.max_new_tokens} = {total} tokens "
                f"exceeds the model's {self.max_seq_len} positions"
            )
        return WorkItem(request_id, tenant, priority, deadline, float(request.prompt_len), request)

    def run_batch(self, batch: Batch) -> list[Outcome]:
        """One model step for every sequence of ``batch`` -> one outcome each."""
        handles = batch.handles
        pad = list(self.padding()) if self.padding is not None else []
        step, sampled, states = self._build_step(handles, pad)
        for table in pad:
            table.computed += 1  # the padded row's token is written and ignored
        with torch.inference_mode():
            self.cache.copy_blocks([pair for h in handles for pair in h.policy_data.copies])
            logits = self.model.forward_paged(step, self.cache)
            finite = torch.isfinite(logits).all(dim=1).cpu().numpy()
            next_tokens = logits.argmax(dim=1).cpu().numpy()
            rows = [(h, st) for h, st, samples in zip(handles, states, sampled) if samples]  # logits row order
            temps = np.array([h.item.payload.temperature for h, _ in rows], dtype=np.float64)
            if temps.size and temps.max() > 0:
                self._sample(logits, next_tokens, temps, rows)
        self.steps += 1
        self.tokens_computed += int(step.tokens.shape[0])
        outcomes: list[Outcome] = []
        row = 0
        for h, state, samples in zip(handles, states, sampled):  # one outcome per sequence
            if not samples:
                outcomes.append(Continue())
                continue
            ok, token = bool(finite[row]), int(next_tokens[row])
            row += 1
            if not ok:
                outcomes.append(Failed(InternalError(
                    f"request {h.request_id}: the model produced non-finite logits at position {state.length - 1} "
                    f"after {state.length - state.prompt_len} generated tokens; this sequence stops, the batch goes on"
                )))
                continue
            outcomes.append(self._emit(h, state, token))
        return outcomes

    @staticmethod
    def _sample(logits: torch.Tensor, next_tokens: np.ndarray, temps: np.ndarray, rows: list[tuple[Handle, SequenceState]]) -> None:
        """Replace the greedy ``next_tokens`` ([S] int64) of the rows whose temperature
        ``temps`` ([S]) is > 0 by a sample from softmax(logits / T) ([S, V] logits): the
        Gumbel-max trick, argmax(logits / T + g), with the noise ``g`` drawn from (the
        request's seed, the position being generated). So a row's draw depends on neither
        its batch neighbours nor the step it lands in, and a preempted sequence recomputes
        the same tokens; the same seed gives the same text."""
        hot = np.flatnonzero(temps > 0)
        dev = logits.device
        scaled = (logits.index_select(0, torch.from_numpy(hot).to(dev)).double()
                  / torch.from_numpy(temps[hot]).to(dev)[:, None]).cpu().numpy()  # [H, V]
        vocab = scaled.shape[1]
        noise = np.stack([  # per sampling sequence (not per token): one V-wide draw each
            np.random.default_rng((rows[i][0].item.payload.seed & _SEED_MASK, rows[i][1].length)).gumbel(size=vocab) for i in hot
        ])
        next_tokens[hot] = (scaled + noise).argmax(axis=1)

    @staticmethod
    def _emit(h: Handle, state: SequenceState, token: int) -> Outcome:
        request: GenerationRequest = h.item.payload
        state.tokens[state.length] = token
        state.length += 1
        generated = state.length - state.prompt_len
        if (generated >= request.max_new_tokens or token == request.stop_token
                or (request.stop_after is not None and generated >= request.stop_after)):
            return Done(state.generated.copy())
        return Continue(partial_output=token, new_cost=float(state.length))

    def _build_step(self, handles: tuple[Handle, ...], pad: Sequence[BlockTable] = ()) -> tuple[PagedStep, np.ndarray, list[SequenceState]]:
        """Flat step tensors from the handles' block tables (then one token per padding
        row); also which of the handles sample ([len(handles)] bool) and their states."""
        n_real = len(handles)
        s = n_real + len(pad)
        starts = np.empty(s, dtype=np.int64)
        lens = np.empty(s, dtype=np.int64)
        known = np.empty(s, dtype=np.int64)
        widths = np.empty(s, dtype=np.int64)
        states: list[SequenceState] = []
        chunks: list[np.ndarray] = []
        tables: list[list[int]] = []
        for i, h in enumerate(handles):  # per sequence: gather its metadata
            state = h.state
            if state is None:
                state = h.state = SequenceState.start(h.item.payload)
            table = h.policy_data
            start, n = table.computed, table.step_tokens
            if n < 1 or start + n > state.length:
                raise InternalError(f"request {h.request_id}: step plans tokens {start}..{start + n} of {state.length} known")
            starts[i], lens[i], known[i], widths[i] = start, n, state.length, len(table.blocks)
            states.append(state)
            chunks.append(state.tokens[start : start + n])
            tables.append(table.blocks)
        for j, table in enumerate(pad, start=n_real):  # padding rows: one ignored token each, never sampled
            starts[j], lens[j], known[j], widths[j] = table.computed, 1, table.computed + 2, len(table.blocks)
            chunks.append(np.zeros(1, dtype=np.int64))
            tables.append(table.blocks)
        bt = self.block_tokens
        table_mat = np.zeros((s, int(widths.max())), dtype=np.int64)
        for i, blocks in enumerate(tables):
            table_mat[i, : len(blocks)] = blocks
        tokens = np.concatenate(chunks)
        first = np.cumsum(lens) - lens  # flat row of each sequence's first token
        seq_of = np.repeat(np.arange(s), lens)
        positions = np.repeat(starts, lens) + (np.arange(tokens.shape[0]) - np.repeat(first, lens))
        write_slots = table_mat[seq_of, positions // bt] * bt + positions % bt
        ctx = starts + lens
        sampled = ctx == known
        dec, pre = np.flatnonzero(lens == 1), np.flatnonzero(lens > 1)
        dev = self.device
        step = PagedStep(
            tokens=torch.from_numpy(tokens).to(dev), positions=torch.from_numpy(positions).to(dev),
            write_slots=torch.from_numpy(write_slots).to(dev),
            decode=self._decode_group(dec, ctx, first, table_mat) if dec.size else None,
            prefill=self._prefill_group(pre, starts, lens, ctx, first, table_mat) if pre.size else None,
            sample_index=torch.from_numpy((first + lens - 1)[sampled]).to(dev),
        )
        return step, sampled[:n_real], states

    def _decode_group(self, idx: np.ndarray, ctx: np.ndarray, first: np.ndarray, table_mat: np.ndarray) -> DecodeGroup:
        """Ragged attention inputs for the one-token sequences ``idx`` (see :class:`DecodeGroup`)."""
        bt = self.block_tokens
        n_keys = ctx[idx]
        key_seq = np.repeat(np.arange(idx.size), n_keys)
        key_pos = np.arange(int(n_keys.sum())) - np.repeat(np.cumsum(n_keys) - n_keys, n_keys)
        key_slots = table_mat[idx[key_seq], key_pos // bt] * bt + key_pos % bt
        dev = self.device
        return DecodeGroup(q_rows=torch.from_numpy(first[idx]).to(dev), key_slots=torch.from_numpy(key_slots).to(dev),
                           key_seq=torch.from_numpy(key_seq).to(dev))

    def _prefill_group(self, idx: np.ndarray, starts: np.ndarray, lens: np.ndarray, ctx: np.ndarray, first: np.ndarray, table_mat: np.ndarray) -> AttnGroup:
        """Padded attention inputs for the prefill chunks ``idx`` (see :class:`AttnGroup`)."""
        bt = self.block_tokens
        q_w, c_w = int(lens[idx].max()), int(ctx[idx].max())
        qi = np.arange(q_w)
        q_valid = qi[None, :] < lens[idx, None]
        q_index = np.where(q_valid, first[idx, None] + qi[None, :], 0)
        q_pos = np.where(q_valid, starts[idx, None] + qi[None, :], 0)  # padding attends key 0 only
        key_pos = np.arange(c_w)
        ctx_valid = key_pos[None, :] < ctx[idx, None]
        slots = table_mat[idx][:, np.minimum(key_pos // bt, table_mat.shape[1] - 1)] * bt + key_pos % bt
        ctx_slots = np.where(ctx_valid, slots, self.cache.null_slot).reshape(-1)
        mask = ctx_valid[:, None, :] & (key_pos[None, None, :] <= q_pos[:, :, None])
        dev = self.device

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

        return AttnGroup(q_index=t(q_index), q_valid=t(q_valid), out_rows=t(q_index[q_valid]), valid_flat=t(np.flatnonzero(q_valid)),
                         ctx_slots=t(ctx_slots), mask=t(mask))


def build(
    config: GenerationConfig, model: TinyDecoder | None = None, *, admission: AdmissionConfig = AdmissionConfig(),
    seed: int = 0,
) -> tuple[Scheduler, DecodeEngine]:
    """Model (random-init from ``seed`` unless given), pool, the registered
    ``PolicyKind.CONTINUOUS`` policy and a scheduler core around it."""
    device = resolve_device(config.device)
    if model is None:
        torch.manual_seed(seed)
        model = TinyDecoder(config.model)
    model = model.to(device)
    cache = PagedKvCache(model.config, config.batching.kv, dtype=model.dtype, device=device)
    policy_module.register()
    policy = make_policy(PolicyKind.CONTINUOUS, config.batching)
    return Scheduler(policy, admission), DecodeEngine(model, cache)


def run_step(scheduler: Scheduler, engine: DecodeEngine, now: float, *, done_at: float | None = None) -> Batch | None:
    """Form one step at ``now``, run it, complete it at ``done_at`` (default ``now``).
    Returns the batch, or None when the policy formed none."""
    batch = scheduler.schedule(now)
    if batch is None:
        return None
    try:
        outcomes: Any = engine.run_batch(batch)
    except BaseException as exc:
        scheduler.fail(batch, exc, now if done_at is None else done_at)
        raise
    scheduler.complete(batch, outcomes, now if done_at is None else done_at)
    return batch
