"""Static batching, the baseline of ``recserve bench decode`` (reference §10.6.4–10.6.5).

Fixed membership: when nothing is running it admits up to ``max_seqs`` queued sequences,
reserving for each the contiguous KV a server must hold when it cannot know the output
length — prompt + ``max_new_tokens`` tokens, not the context limit — then runs exactly
those until the longest finishes; only then does it admit again. Prompts prefill whole
in the first step. A finished member frees its reservation (it is released) but its slot
stays empty until the batch drains. It reuses the paged pool and engine so the only
difference measured is the scheduling; it is not registered as a policy kind.
"""

from __future__ import annotations

from recserve.scheduling import SchedulerView

from generation.blocks import BlockTable
from generation.policy import PagedPolicy
from generation.types import known_tokens, request_of


class StaticBatchPolicy(PagedPolicy):
    """Fixed-membership batches with contiguous (prompt + max_new_tokens) reservations."""

    def select(self, view: SchedulerView, now: float) -> None:
        if view.inflight_batches:
            return
        residents = view.resident
        if residents:
            for h in residents:
                table: BlockTable = h.policy_data
                self._plan(table, len(known_tokens(h)))
                view.run(h)
            return
        kv = self.config.kv
        while self.live < self.config.max_seqs and (head := view.peek()) is not None:
            request = request_of(head)
            reserve = kv.blocks_for(request.prompt_len + request.max_new_tokens)
            if reserve > self.pool.free_count:
                break
            table = BlockTable()
            table.blocks = [self.pool.allocate() for _ in range(reserve)]  # the whole reservation, up front
            self._admit(view, head, table)
            self._plan(table, len(known_tokens(head)))

    @staticmethod
    def _plan(table: BlockTable, known: int) -> None:
        """Everything not yet computed: the whole prompt at first, then one token."""
        table.step_tokens = known - table.computed
