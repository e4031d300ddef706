"""Static batching, the baseline of ``recserve bench decode`` (reference §10.6.4–10.6.5).

Fixed membership: when nothing is running it admits up to ``max_seqs`` queued sequences,
reserving for each the contiguous KV a server must hold when it cannot know the output
length — prompt + ``max_new_tokens`` tokens, not the context limit — then runs exactly
those until the longest finishes; only then does it admit again. Prompts prefill whole
in the first step. A finished member's slot stays taken until the batch drains: with
``padded`` (the default, reference §10.6.5's waste model: a fixed-width kernel computes
every row every iteration) its row keeps being computed and discarded — hand
:meth:`padding_rows` to the engine — and its reservation comes back when the batch
drains; without, the finished row is skipped and its reservation freed at once (a kernel
that skips completed sequences). It reuses the paged pool and engine so the only
difference measured is the scheduling; it is not registered as a policy kind.
"""

from __future__ import annotations

from recserve.scheduling import Handle, SchedulerView

from generation.blocks import BlockTable
from generation.config import ContinuousBatchConfig
from generation.policy import PagedPolicy
from generation.types import known_tokens, request_of


class StaticBatchPolicy(PagedPolicy):
    """Fixed-membership batches with contiguous (prompt + max_new_tokens) reservations."""

    def __init__(self, config: ContinuousBatchConfig, *, padded: bool = True) -> None:
        super().__init__(config)
        self.padded = padded
        self.members = 0  # unfinished members of the current batch
        self._padding: list[BlockTable] = []

    def padding_rows(self) -> list[BlockTable]:
        """Finished members' tables whose rows the current batch still computes (while
        their reservation has room: a member with a smaller ``max_new_tokens`` than the
        longest stops padding at its own limit)."""
        bt = self.block_tokens
        return [t for t in self._padding if t.computed < len(t.blocks) * bt]

    def on_finish(self, handle: Handle, now: float) -> None:
        self._leave(handle, pad=self.padded)

    def on_requeue(self, handle: Handle, now: float) -> None:
        self._leave(handle, pad=False)  # handed back by the runner: it is no member any more

    def _leave(self, handle: Handle, *, pad: bool) -> None:
        table = handle.policy_data
        if table is None:
            return
        self.members -= 1
        if pad and self.members > 0:
            handle.policy_data = None
            self._padding.append(table)  # its slot and reservation stay with the batch
            return
        self._release(handle)
        if self.members == 0:  # the batch drained: padded slots come back
            for rows in self._padding:
                self.pool.release(rows)
            self.live -= len(self._padding)
            self._padding = []

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
            self.members += 1
            self._plan(table, len(known_tokens(head)))

    @staticmethod
    def _plan(table: BlockTable, known: int) -> None:
        """Everything not yet computed: the whole prompt at first, then one token."""
        table.step_tokens = known - table.computed
