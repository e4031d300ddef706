"""Iteration-level decode scheduling over a paged KV pool, on the shared scheduler core.

:class:`ContinuousBatchPolicy` is the ``PolicyKind.CONTINUOUS`` policy (registered when
this module is imported; :func:`register` re-registers it). At every step, with one step
in flight at a time (reference §10.6.4, Algorithm 1; §10.8.2, Algorithm 3):

1. **Room for the running set.** Each resident sequence needs room for at least one more
   token. While their new blocks exceed the free pool, the victim — lowest priority
   class first, then most remaining work (``max_new_tokens`` left plus prompt left to
   prefill) — gives its blocks back and returns to the queue with its generated tokens;
   it is recomputed when readmitted (reference §10.7.7). No admission in a step that
   preempted for room, so a victim is not readmitted at once. Then, if the queue's head
   is of a more urgent class than some residents and finds no room (blocks for its
   first chunk, or a sequence slot), the least urgent of those are preempted for it; a
   victim is never readmitted in the step that preempted it.
2. **Decodes first**, one token each, in priority / deadline order, then **prefill
   chunks** of residents still prefilling (at most ``prefill_chunk_tokens`` each), all
   within ``token_budget`` tokens per step: a long prompt advances a chunk per step and
   the decodes beside it keep a bounded time between tokens.
3. **Admission** from the EDF queue while a sequence slot (``max_seqs``), budget and
   blocks remain: the prompt's full blocks found in the prefix cache (same tenant, same
   model version) are taken by reference and skipped; the rest is prefilled in chunks.

Blocks come back the moment a sequence ends (a failed one's also leave the prefix cache,
so a cached NaN cannot fail later requests): finished, failed, cancelled (queued or
resident: at once; in flight: when its step completes), dropped at its deadline (the
core expires resident items before every step, so nothing decodes for a caller who has
gone), or preempted. ``Handle.policy_data`` is the sequence's :class:`BlockTable`: the
engine reads which tokens to compute and where their K/V lives.
"""

from __future__ import annotations

from recserve.errors import InvalidArgument
from recserve.scheduling import Handle, ItemStatus, Policy, PolicyKind, SchedulerView, register_policy

from generation.blocks import BlockPool, BlockTable, prefix_keys
from generation.config import ContinuousBatchConfig
from generation.types import generated_count, known_tokens, request_of


def _keep_order(h: Handle) -> tuple[int, float, int]:
    return (int(h.priority), h.deadline, h.seq)


class PagedPolicy(Policy):
    """What both decode policies share: the block pool and the hooks that keep a
    sequence's blocks in step with its life in the core."""

    kind = PolicyKind.CONTINUOUS

    def __init__(self, config: ContinuousBatchConfig) -> None:
        self.config = config
        self.block_tokens = config.kv.block_tokens
        self.pool = BlockPool(config.kv.num_blocks)
        self.live = 0  # sequences holding blocks
        self.peak_live = 0
        self.preemptions = 0
        self.prefix_hit_blocks = 0

    # ------------------------------------------------------------- lifecycle hooks
    def on_add(self, handle: Handle, now: float) -> None:
        request = request_of(handle)
        need = self.config.kv.blocks_for(request.prompt_len + request.max_new_tokens)
        if need > self.config.kv.num_blocks:
            raise InvalidArgument(
                f"request {handle.request_id}: prompt {request.prompt_len} + max_new_tokens {request.max_new_tokens} tokens "
                f"need {need} KV blocks of {self.block_tokens}; the pool has {self.config.kv.num_blocks}"
            )

    def on_continue(self, handle: Handle, now: float) -> None:
        table: BlockTable = handle.policy_data
        table.computed += table.step_tokens
        table.step_tokens = 0
        table.copies.clear()
        full = min(table.computed // self.block_tokens, len(table.keys))
        for i in range(table.registered, full):  # per block that just filled up (usually none)
            self.pool.register(table.keys[i], table.blocks[i])
        table.registered = max(table.registered, full)

    def on_requeue(self, handle: Handle, now: float) -> None:
        self._release(handle)

    def on_finish(self, handle: Handle, now: float) -> None:
        table = handle.policy_data
        if table is not None and handle.status is ItemStatus.FAILED:
            # Non-finite logits (or a failed runner): some K/V it read may be bad, a
            # shared prefix block too. Unpublish its blocks so later sequences recompute
            # that prefix rather than fail on a cached NaN; current holders are not touched.
            self.pool.forget(table.blocks)
        self._release(handle)

    def ready_at(self, view: SchedulerView, now: float) -> float | None:
        # One step in flight; otherwise there is always something to run: a resident
        # sequence always gets room (victims are preempted), and with none resident the
        # whole pool is free and on_add refused anything larger than it.
        if view.inflight_batches:
            return None
        return now if view.resident_count or view.queued_count else None

    def gauges(self) -> dict[str, float]:
        pool = self.pool
        return {
            "kv_blocks_total": float(pool.num_blocks), "kv_blocks_used": float(pool.used_count),
            "kv_blocks_cached": float(pool.cached_count), "live_seqs": float(self.live), "peak_live_seqs": float(self.peak_live),
            "preemptions": float(self.preemptions), "prefix_hit_blocks": float(self.prefix_hit_blocks),
            "cow_copies": float(pool.cow_copies), "evictions": float(pool.evictions),
        }

    # ------------------------------------------------------------- helpers
    def _release(self, handle: Handle) -> None:
        table = handle.policy_data
        if table is not None:
            self.pool.release(table)
            handle.policy_data = None
            self.live -= 1

    def _grow(self, table: BlockTable, tokens: int) -> None:
        """Blocks for this step's ``tokens`` (the caller checked they are free)."""
        need = -(-(table.computed + tokens) // self.block_tokens)
        blocks = table.blocks
        while len(blocks) < need:  # per new block: at most a chunk's worth
            blocks.append(self.pool.allocate())
        table.step_tokens = tokens

    def _room_tokens(self, table: BlockTable, free_blocks: int) -> int:
        """Tokens ``table`` can compute with its blocks plus ``free_blocks`` more."""
        return (len(table.blocks) + free_blocks) * self.block_tokens - table.computed

    def _admit(self, view: SchedulerView, handle: Handle, table: BlockTable) -> None:
        view.take()
        handle.policy_data = table
        self.live += 1
        self.peak_live = max(self.peak_live, self.live)


class ContinuousBatchPolicy(PagedPolicy):
    """Continuous batching with chunked prefill, paged KV, CoW prefix sharing and
    preemption by priority then remaining work (see the module docstring)."""

    def select(self, view: SchedulerView, now: float) -> None:
        if view.inflight_batches:
            return
        cfg = self.config
        pool = self.pool
        bt = self.block_tokens
        residents = sorted(view.resident, key=_keep_order)

        # 1. Room for one more token each; preempt victims until the running set fits.
        def growth(h: Handle) -> int:
            table: BlockTable = h.policy_data
            return max(0, -(-(table.computed + 1) // bt) - len(table.blocks))

        need = sum(growth(h) for h in residents)
        preempted = False
        victims: set[int] = set()  # seq of this step's victims: never readmitted in the step that preempted them
        while need > pool.free_count:
            victim = max(residents, key=self._victim_order)
            residents.remove(victim)
            need -= growth(victim)
            self._release(victim)
            view.preempt(victim)  # back to the queue with its generated tokens: recomputed later
            victims.add(victim.seq)
            self.preemptions += 1
            preempted = True

        # 1b. A queued sequence of a more urgent class than some resident takes that
        # resident's room (blocks or slot): priority reaches into the running set.
        head = view.peek()
        if head is not None:
            total = len(known_tokens(head))
            first = min(total, cfg.prefill_chunk_tokens or total, cfg.token_budget)
            head_blocks = -(-first // bt)  # ignores prefix hits: errs towards making room
            lower = [h for h in residents if h.priority > head.priority]
            while lower and (pool.free_count - need < head_blocks or len(residents) >= cfg.max_seqs):
                victim = max(lower, key=self._victim_order)
                lower.remove(victim)
                residents.remove(victim)
                need -= growth(victim)
                self._release(victim)
                view.preempt(victim)
                victims.add(victim.seq)
                self.preemptions += 1

        # 2. Decodes (one token each), then resident prefill chunks, within the budget.
        budget = cfg.token_budget
        prefilling: list[Handle] = []
        for h in residents:
            table = h.policy_data
            if table.computed + 1 < len(known_tokens(h)):
                prefilling.append(h)
            elif budget >= 1:
                self._grow(table, 1)
                view.run(h)
                budget -= 1
        prefills = 0
        for h in prefilling:
            table = h.policy_data
            left = len(known_tokens(h)) - table.computed
            piece = self._piece(left, budget, prefills)
            piece = min(piece, self._room_tokens(table, pool.free_count))
            if piece >= 1:
                self._grow(table, piece)
                view.run(h)
                budget -= piece
                prefills += 1

        # 3. Admission from the queue (not in a step that had to preempt, unless it is empty).
        if preempted and view.batch_size:
            return
        live = len(residents)
        sharing = cfg.kv.prefix_sharing
        while live < cfg.max_seqs and (head := view.peek()) is not None:
            if head.seq in victims:
                # A victim freed a whole sequence's blocks, usually more than the urgent
                # arrival needed; readmitting it now would only recompute it and take back
                # the room it was preempted for (thrash). It waits one step; head-of-line.
                break
            tokens = known_tokens(head)
            total = len(tokens)
            keys = prefix_keys(head.item.tenant, cfg.kv.model_version, tokens, bt) if sharing else []
            hits, hits_evictable = pool.peek_match(keys)
            # The last known token is always computed (its logits give the next token); a
            # fully cached prompt therefore writes into its last shared block: copy-on-write.
            computed = min(hits * bt, total - 1)
            cow = 1 if hits and hits * bt > computed else 0
            piece = self._piece(total - computed, budget, prefills)
            available = pool.free_count - hits_evictable - cow
            piece = min(piece, (hits + available) * bt - computed)
            if piece < 1:
                break  # head-of-line: later arrivals do not overtake the queue order
            table = BlockTable(keys=keys)
            table.blocks = pool.match(keys[:hits])
            table.registered = table.prefix_hit_blocks = hits
            table.computed = computed
            if cow:
                pool.make_private(table, hits - 1)
            self.prefix_hit_blocks += hits
            self._admit(view, head, table)
            self._grow(table, piece)
            budget -= piece
            prefills += 1
            live += 1
            if budget <= 0:
                break

    def _piece(self, left: int, budget: int, prefills_in_step: int) -> int:
        """This step's prefill piece for ``left`` tokens to go: a chunk within the budget,
        or (unchunked) all of it — over budget only as the step's first prefill."""
        chunk = self.config.prefill_chunk_tokens
        if chunk is None:
            return left if left <= budget or prefills_in_step == 0 else 0
        return max(0, min(chunk, left, budget))

    @staticmethod
    def _victim_order(h: Handle) -> tuple[int, int, int]:
        """Larger = preempted first: lowest class, then most remaining work, then newest."""
        request = request_of(h)
        table: BlockTable = h.policy_data
        remaining = (request.max_new_tokens - generated_count(h)) + (len(known_tokens(h)) - table.computed)
        return (int(h.priority), remaining, h.seq)


def register() -> None:
    """Register :class:`ContinuousBatchPolicy` as ``PolicyKind.CONTINUOUS`` (idempotent).
    Import-time registration can be undone by tests that swap in their own policy, so
    builders call this before ``make_policy``."""
    register_policy(PolicyKind.CONTINUOUS, ContinuousBatchPolicy, replace=True)


register()
