"""L3 reranker: the candidate attends over the user's last N history items.

The query is the candidate's ``l3_item`` + ``l3_category`` rows and mean ``l3_tag``
row (pooled lookups), projected to E; keys and values are the user's last
``config.history`` history items as *unpooled* rows (``l3_item`` and ``l3_category``
per item, ``[B, N, E]`` each). One attention head: weights softmax(q·k/√E) over the
valid history slots. An MLP scores [q, context, q ⊙ context, dense features].

The catalog's histories are unordered and its click model has no sequence term, so
"last N" is a window, not a recency signal; L3 is not expected to beat DLRM here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from ranker.config import L3Config
from ranker.features import NUM_DENSE, Source, SparseFeature
from ranker.models.common import gather_rows, mean_pool, pad_jagged


def l3_features(history: int) -> tuple[tuple[SparseFeature, ...], tuple[SparseFeature, ...]]:
    """(pooled candidate features, unpooled history features) for a window of
    ``history`` items."""
    pooled = (
        SparseFeature("l3_candidate_item", "l3_item", Source.CANDIDATE_ITEM),
        SparseFeature("l3_candidate_category", "l3_category", Source.CANDIDATE_CATEGORY),
        SparseFeature("l3_candidate_tags", "l3_tag", Source.CANDIDATE_TAGS),
    )
    unpooled = (
        SparseFeature("l3_history_items", "l3_item", Source.HISTORY_ITEMS, last=history),
        SparseFeature("l3_history_categories", "l3_category", Source.HISTORY_CATEGORIES, last=history),
    )
    return pooled, unpooled


INIT_STD = 0.05


class L3Reranker(nn.Module):
    """See the module docstring. :meth:`score_looked_up` is the serving-side forward on
    looked-up rows; :meth:`forward` looks them up in process first."""

    def __init__(self, config: L3Config, table_rows: Mapping[str, int], generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.config = config
        self.table_rows = dict(table_rows)
        e = config.embedding_dim
        self.tables = nn.ParameterDict({t: nn.Parameter(torch.empty(int(table_rows[t]), e)) for t in ("l3_item", "l3_category", "l3_tag")})
        with torch.no_grad():
            for w in self.tables.values():
                w.normal_(0.0, INIT_STD, generator=generator)
        self.query = nn.Linear(3 * e, e)
        self.key = nn.Linear(2 * e, e)
        self.value = nn.Linear(2 * e, e)
        self.head = nn.Sequential(nn.Linear(3 * e + NUM_DENSE, config.hidden), nn.ReLU(), nn.Linear(config.hidden, 1))
        self.pooled_features, self.unpooled_features = l3_features(config.history)

    def score_looked_up(self, pooled: Mapping[str, torch.Tensor], rows: Mapping[str, torch.Tensor], lengths: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """``[B]`` logits.

        ``pooled``: ``[B, E]`` per pooled candidate feature; ``rows``: ``[L, E]`` unpooled
        rows per history feature, examples concatenated; ``lengths`` ``[B]`` int64 rows
        per example (<= ``config.history``); ``dense`` ``[B, NUM_DENSE]``.
        """
        n = self.config.history
        hist_items, mask = pad_jagged(rows["l3_history_items"], lengths, n)
        hist_cats, _ = pad_jagged(rows["l3_history_categories"], lengths, n)
        q = self.query(torch.cat([pooled["l3_candidate_item"], pooled["l3_candidate_category"], pooled["l3_candidate_tags"]], dim=1))  # [B, E]
        kv = torch.cat([hist_items, hist_cats], dim=2)  # [B, N, 2E]
        att = torch.einsum("bne,be->bn", self.key(kv), q) / math.sqrt(self.config.embedding_dim)
        # Masked slots get -inf; an empty history (all masked) gets zero weights, not NaN.
        w = torch.softmax(att.masked_fill(~mask, float("-inf")), dim=1).nan_to_num(0.0)
        context = torch.einsum("bn,bne->be", w, self.value(kv))
        out: torch.Tensor = self.head(torch.cat([q, context, q * context, dense], dim=1)).squeeze(-1)
        return out

    def lookup(self, jagged: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
        """In-process lookups: feature -> (values [L], lengths [B]) -> (pooled, rows, lengths)."""
        pooled = {f.name: mean_pool(self.tables[f.table], *jagged[f.name]) for f in self.pooled_features}
        rows = {f.name: gather_rows(self.tables[f.table], jagged[f.name][0]) for f in self.unpooled_features}
        return pooled, rows, jagged["l3_history_items"][1]

    def forward(self, jagged: Mapping[str, tuple[torch.Tensor, torch.Tensor]], dense: torch.Tensor) -> torch.Tensor:
        return self.score_looked_up(*self.lookup(jagged), dense)
