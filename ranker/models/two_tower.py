"""Two-tower retrieval model.

User tower (online): mean-pooled ``tt_item`` rows of the user's history and
``tt_category`` rows of their categories, plus user dense features
(:func:`ranker.features.user_dense_features`), through an MLP to a unit ``out_dim``
vector. Item tower (offline, over the whole catalog): the item's own ``tt_item`` and
``tt_category`` rows and its mean ``tt_tag`` row plus item dense features, through an
MLP to a unit vector. The history and item towers share ``tt_item``: an item seen in
histories and an item scored as a candidate live in one space.

Only the user tower's tables (``tt_item``, ``tt_category``) go to the shards; the item
tower's output is exported for the FAISS index.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ranker.config import TwoTowerConfig
from ranker.features import Source, SparseFeature
from ranker.models.common import mean_pool

USER_TOWER_FEATURES: tuple[SparseFeature, ...] = (
    SparseFeature("tt_history_items", "tt_item", Source.HISTORY_ITEMS),
    SparseFeature("tt_history_categories", "tt_category", Source.HISTORY_CATEGORIES),
)
ITEM_TOWER_FEATURES: tuple[SparseFeature, ...] = (
    SparseFeature("tt_item_id", "tt_item", Source.CANDIDATE_ITEM),
    SparseFeature("tt_item_category", "tt_category", Source.CANDIDATE_CATEGORY),
    SparseFeature("tt_item_tags", "tt_tag", Source.CANDIDATE_TAGS),
)
USER_DENSE = 3
ITEM_DENSE = 2
INIT_STD = 0.05


def _mlp(n_in: int, hidden: int, n_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, n_out))


class TwoTower(nn.Module):
    """Both towers; see the module docstring. Vectors are L2-normalised ``[B, out_dim]``."""

    def __init__(self, config: TwoTowerConfig, table_rows: Mapping[str, int], generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.config = config
        self.table_rows = dict(table_rows)
        e, c = config.embedding_dim, config.category_width
        widths = {"tt_item": e, "tt_category": c, "tt_tag": e}
        self.tables = nn.ParameterDict({t: nn.Parameter(torch.empty(int(table_rows[t]), w)) for t, w in widths.items()})
        with torch.no_grad():
            for w in self.tables.values():
                w.normal_(0.0, INIT_STD, generator=generator)
        self.user_mlp = _mlp(e + c + USER_DENSE, config.hidden, config.out_dim)
        self.item_mlp = _mlp(2 * e + c + ITEM_DENSE, config.hidden, config.out_dim)

    def user_from_pooled(self, pooled: Mapping[str, torch.Tensor], user_dense: torch.Tensor) -> torch.Tensor:
        """``[B, out_dim]`` user vectors from pooled ``[B, E]`` blocks of
        USER_TOWER_FEATURES (remote or in-process) and ``user_dense`` [B, USER_DENSE]."""
        x = torch.cat([pooled["tt_history_items"], pooled["tt_history_categories"], user_dense], dim=1)
        return F.normalize(self.user_mlp(x), dim=-1)

    def pool(self, jagged: Mapping[str, tuple[torch.Tensor, torch.Tensor]], features: tuple[SparseFeature, ...]) -> dict[str, torch.Tensor]:
        """In-process pooled lookup: feature -> (values [L], lengths [B]) -> ``[B, E]``."""
        return {f.name: mean_pool(self.tables[f.table], *jagged[f.name]) for f in features}

    def item_vectors(self, jagged: Mapping[str, tuple[torch.Tensor, torch.Tensor]], item_dense: torch.Tensor) -> torch.Tensor:
        """``[B, out_dim]`` item vectors from ITEM_TOWER_FEATURES ids and ``item_dense``."""
        return self.item_from_pooled(self.pool(jagged, ITEM_TOWER_FEATURES), item_dense)

    def item_from_pooled(self, pooled: Mapping[str, torch.Tensor], item_dense: torch.Tensor) -> torch.Tensor:
        """``[B, out_dim]`` item vectors from pooled ``[B, E]`` blocks of ITEM_TOWER_FEATURES
        (remote ``tt_item`` / ``tt_category`` rows, in-process ``tt_tag``) and ``item_dense``
        [B, ITEM_DENSE]: the serving-side item tower, for items added after the export."""
        x = torch.cat([pooled["tt_item_id"], pooled["tt_item_category"], pooled["tt_item_tags"], item_dense], dim=1)
        return F.normalize(self.item_mlp(x), dim=-1)
