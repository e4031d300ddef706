"""The scrubbed view of a catalog: everything a real system has, nothing it does not.

Training code receives a :class:`ScrubbedCatalog`, never a
:class:`recserve.catalog.Catalog`. The view opens only the arrays in
:data:`TRAINING_ARRAYS` (ids, categories, tags, histories and the *train* split of the
impression log) and keeps only the manifest fields in :data:`TRAINING_CONFIG_FIELDS`
(table sizes). The latent vectors (``*_vectors.npy``), the click model's own
popularity (``item_popularity.npy`` and ``items_by_popularity.npy``, its ranking), the
category centroids, the ground-truth parameters, the click-model weights and every seed
are absent by construction: there is no attribute to read them through, and
:func:`open_scrubbed` never opens their files. Popularity features are counted from the
``train.*`` impressions (:mod:`ranker.features`).

The held-out split is opened separately (:func:`open_held_out`): evaluation scores it,
training never sees it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from recserve.catalog.storage import MANIFEST, ClickLog, Csr, open_arrays, read_manifest
from recserve.errors import FailedPrecondition

# The only arrays training may open (manifest names; files are `<name>.npy`).
TRAINING_ARRAYS: tuple[str, ...] = (
    "item_category",
    "item_tags.values",
    "item_tags.offsets",
    "user_history.values",
    "user_history.offsets",
    "train.user",
    "train.item",
    "train.label",
)
HELD_OUT_ARRAYS: tuple[str, ...] = ("test.user", "test.item", "test.label")
# Catalog sizes a real system knows (vocabulary sizes). No seeds, no click-model weights.
TRAINING_CONFIG_FIELDS: tuple[str, ...] = ("items", "users", "categories", "tags")
# What a scrubbed copy of a catalog lacks (the leakage test deletes these).
GROUND_TRUTH_FILES: tuple[str, ...] = ("item_vectors.npy", "user_vectors.npy", "item_popularity.npy", "items_by_popularity.npy", "category_centroids.npy")
GROUND_TRUTH_MANIFEST_FIELDS: tuple[str, ...] = ("seed", "ground_truth", "generator", "summary")


@dataclasses.dataclass(frozen=True)
class ScrubbedCatalog:
    """A catalog minus its ground truth (see the module docstring).

    Shapes (N items, U users): ``item_category`` [N] int64 in [0, categories);
    ``item_tags`` CSR over N items of tag ids in [0, tags); ``user_history`` CSR over U
    users of item ids (unordered); ``train`` the training split of the impression log.
    """

    num_items: int
    num_users: int
    num_categories: int
    num_tags: int
    item_category: np.ndarray
    item_tags: Csr
    user_history: Csr
    train: ClickLog
    path: Path | None = None

    def fingerprint(self) -> str:
        """A short hash of the sizes and the array shapes the view holds (not of the
        ground truth: a scrubbed copy of a catalog has the same fingerprint)."""
        h = hashlib.sha256()
        h.update(json.dumps([self.num_items, self.num_users, self.num_categories, self.num_tags]).encode())
        for a in (self.item_category, self.item_tags.values, self.user_history.values, self.train.label):
            h.update(str(a.shape).encode())
        return h.hexdigest()[:12]


def open_scrubbed(path: Path | str) -> ScrubbedCatalog:
    """Open the scrubbed view of the catalog directory ``path`` (memory-mapped).

    Reads only :data:`TRAINING_ARRAYS` and the :data:`TRAINING_CONFIG_FIELDS` of the
    manifest's config, so it works the same on a copy with the ground truth deleted.
    """
    directory = Path(path)
    manifest = read_manifest(directory)
    config = manifest.get("config", {})
    missing = [f for f in TRAINING_CONFIG_FIELDS if not isinstance(config.get(f), int)]
    if missing:
        raise FailedPrecondition(f"{directory / MANIFEST} config lacks integer fields {missing}; regenerate the catalog")
    a = open_arrays(directory, manifest, TRAINING_ARRAYS)
    return ScrubbedCatalog(
        num_items=int(config["items"]),
        num_users=int(config["users"]),
        num_categories=int(config["categories"]),
        num_tags=int(config["tags"]),
        item_category=a["item_category"],
        item_tags=Csr(a["item_tags.values"], a["item_tags.offsets"]),
        user_history=Csr(a["user_history.values"], a["user_history.offsets"]),
        train=ClickLog(a["train.user"], a["train.item"], a["train.label"]),
        path=directory,
    )


def with_impressions(view: ScrubbedCatalog, extra: ClickLog) -> tuple[ScrubbedCatalog, int]:
    """``view`` with ``extra`` impressions (``[n]`` int64 user, int64 item, uint8 label:
    e.g. a serving log read back by ``cascade.serving_log``) appended to its train split,
    after the catalog's rows since they happened later; and how many rows were dropped
    because their user or item is outside the tables (a new user, an item added after the
    catalog), which the models have no row for. Counts and features then see them like
    any other training impression."""
    keep = (extra.user >= 0) & (extra.user < view.num_users) & (extra.item >= 0) & (extra.item < view.num_items)
    train = ClickLog(
        np.concatenate((np.asarray(view.train.user, dtype=np.int64), np.asarray(extra.user, dtype=np.int64)[keep])),
        np.concatenate((np.asarray(view.train.item, dtype=np.int64), np.asarray(extra.item, dtype=np.int64)[keep])),
        np.concatenate((np.asarray(view.train.label, dtype=np.uint8), np.asarray(extra.label, dtype=np.uint8)[keep])),
    )
    return dataclasses.replace(view, train=train), int(keep.shape[0] - int(keep.sum()))


def open_held_out(path: Path | str) -> ClickLog:
    """The held-out (test) split of the catalog at ``path``: evaluation only."""
    directory = Path(path)
    a = open_arrays(directory, read_manifest(directory), HELD_OUT_ARRAYS)
    return ClickLog(a["test.user"], a["test.item"], a["test.label"])
