"""Synthetic catalogs: items, users, popularity, ground truth, click log (docs/architecture.md §2).

Entry points: :func:`generate_catalog` (from a validated :class:`CatalogConfig`),
:func:`load_catalog` (memory-mapped), the popularity helpers :func:`zipf_weights`,
:func:`sample_lookup_stream` / :class:`PopularitySampler` and :func:`popularity_shares`,
and :func:`summarize` / :func:`format_summary`.

Names resolve lazily, so ``recserve.catalog.config`` (what ``recserve --help`` needs)
loads without numpy or tqdm; nothing here ever imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recserve.catalog.config import FORMAT_VERSION, CatalogConfig
    from recserve.catalog.generate import generate_catalog
    from recserve.catalog.model import GroundTruth
    from recserve.catalog.storage import ARRAY_NAMES, Catalog, ClickLog, Csr, load_catalog, read_manifest
    from recserve.catalog.summary import format_summary, summarize
    from recserve.catalog.zipf import PopularitySampler, PopularityShares, popularity_shares, sample_lookup_stream, zipf_weights

_EXPORTS: dict[str, str] = {
    "FORMAT_VERSION": "config",
    "CatalogConfig": "config",
    "generate_catalog": "generate",
    "GroundTruth": "model",
    "ARRAY_NAMES": "storage",
    "Catalog": "storage",
    "ClickLog": "storage",
    "Csr": "storage",
    "load_catalog": "storage",
    "read_manifest": "storage",
    "format_summary": "summary",
    "summarize": "summary",
    "PopularitySampler": "zipf",
    "PopularityShares": "zipf",
    "popularity_shares": "zipf",
    "sample_lookup_stream": "zipf",
    "zipf_weights": "zipf",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'recserve.catalog' has no attribute {name!r}")
    return getattr(importlib.import_module(f"recserve.catalog.{module}"), name)
