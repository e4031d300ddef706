"""The ground-truth click model that labels a synthetic catalog's impression log.

``logit = affinity_weight · <u, v> + popularity_weight · log(items · pop) + bias``
and a click is Bernoulli(sigmoid(logit)). ``items · pop`` is popularity relative to a
uniform catalog (1 = average item), so ``bias`` is the logit of an average item shown to
an orthogonal user. Trained rankers are judged against this model's AUC on the held-out
split: it is the best any model can do on the log.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from recserve.errors import InvalidArgument


@dataclasses.dataclass(frozen=True)
class GroundTruth:
    """Parameters of the click model (see the module docstring)."""

    affinity_weight: float
    popularity_weight: float
    bias: float
    num_items: int

    def logits(self, user_vectors: np.ndarray, item_vectors: np.ndarray, item_popularity: np.ndarray) -> np.ndarray:
        """Row-wise click logits.

        ``user_vectors`` ``[n, D]`` and ``item_vectors`` ``[n, D]`` are the paired latent
        vectors of n impressions, ``item_popularity`` ``[n]`` the items' popularity (shares
        summing to 1 over the catalog). Returns ``[n]`` float64.
        """
        if user_vectors.shape != item_vectors.shape or user_vectors.ndim != 2 or item_popularity.shape != user_vectors.shape[:1]:
            raise InvalidArgument(f"logits: users {user_vectors.shape}, items {item_vectors.shape}, popularity {item_popularity.shape}; pass [n, D], [n, D] and [n]")
        affinity = np.einsum("nd,nd->n", user_vectors, item_vectors, dtype=np.float64)
        # Items of zero popularity are never sampled; clamp so log() stays finite anyway.
        rel_pop = np.maximum(item_popularity.astype(np.float64) * self.num_items, 1e-300)
        return self.affinity_weight * affinity + self.popularity_weight * np.log(rel_pop) + self.bias

    def click_probability(self, user_vectors: np.ndarray, item_vectors: np.ndarray, item_popularity: np.ndarray) -> np.ndarray:
        """``[n]`` float64 click probabilities, sigmoid of :meth:`logits`."""
        z = self.logits(user_vectors, item_vectors, item_popularity)
        # 0.5·(1 + tanh(z/2)) is sigmoid without exp overflow warnings for large |z|.
        return 0.5 * (1.0 + np.tanh(0.5 * z))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GroundTruth:
        return cls(float(data["affinity_weight"]), float(data["popularity_weight"]), float(data["bias"]), int(data["num_items"]))
