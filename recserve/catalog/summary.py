"""A short, JSON-able summary of a catalog (``recserve catalog info``, ``make demo``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from recserve.catalog.storage import Catalog
from recserve.catalog.zipf import popularity_shares


def summarize(catalog: Catalog, head_fraction: float = 0.01, tail_fraction: float = 0.5) -> dict[str, Any]:
    """Counts, popularity head/tail shares and click-through rates, computed from the
    arrays themselves (not copied from the manifest)."""
    cfg = catalog.config
    shares = popularity_shares(catalog.item_popularity, head_fraction, tail_fraction)
    out: dict[str, Any] = {
        "path": str(catalog.path) if catalog.path is not None else None,
        "items": catalog.num_items,
        "users": catalog.num_users,
        "dim": catalog.dim,
        "categories": int(catalog.category_centroids.shape[0]),
        "tags": cfg.tags,
        "zipf": cfg.zipf,
        "seed": cfg.seed,
        "head_fraction": shares.head_fraction,
        "head_share": shares.head_share,
        "tail_fraction": shares.tail_fraction,
        "tail_share": shares.tail_share,
        "tags_per_item": float(catalog.item_tags.values.shape[0] / max(1, catalog.num_items)),
        "history_mean_len": float(catalog.user_history.values.shape[0] / max(1, catalog.num_users)),
        "train_impressions": len(catalog.train),
        "test_impressions": len(catalog.test),
        "train_ctr": float(np.mean(catalog.train.label, dtype=np.float64)),
        "test_ctr": float(np.mean(catalog.test.label, dtype=np.float64)),
    }
    if catalog.path is not None:
        out["disk_bytes"] = int(sum(f.stat().st_size for f in catalog.path.iterdir() if f.is_file()))
    return out


def format_summary(summary: dict[str, Any]) -> str:
    """Human-readable lines for :func:`summarize`'s output."""
    s = summary
    lines = [
        f"catalog     {s['path'] or '(in memory)'}",
        f"items       {s['items']:,} × {s['dim']} dims, {s['categories']:,} categories, {s['tags']:,} tags ({s['tags_per_item']:.2f} per item)",
        f"users       {s['users']:,} (history {s['history_mean_len']:.1f} items on average)",
        f"popularity  Zipf({s['zipf']}): top {s['head_fraction']:.0%} of items carry {s['head_share']:.1%} of traffic, bottom {s['tail_fraction']:.0%} carry {s['tail_share']:.1%}",
        f"click log   {s['train_impressions']:,} train (CTR {s['train_ctr']:.2%}), {s['test_impressions']:,} held out (CTR {s['test_ctr']:.2%})",
        f"seed        {s['seed']}",
    ]
    if "disk_bytes" in s:
        lines.append(f"on disk     {s['disk_bytes'] / 2**20:,.1f} MiB")
    return "\n".join(lines)
