"""The feature-parallel lookup client (docs/architecture.md §5; reference §10.6.6).

Public API (imported lazily, so ``import recserve.lookup.config`` stays light; the
client itself needs torch)::

    from recserve.lookup import LookupClient, LookupClientConfig, LookupResult

Modules: ``config`` (the one validated config), ``types`` (caller input / result),
``validate`` (per-caller checks), ``window`` (merge + dedup), ``route`` (ids -> shards),
``wire`` (protos), ``reassemble`` (rows / pooled bags), ``near_cache``, ``health``
(hedge delay, budget, breakers), ``transport`` (gRPC edge), ``fanout`` (one window's
life), ``runtime`` (state shared across windows), ``upsert``, ``client``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LookupClient": "recserve.lookup.client",
    "LookupClientConfig": "recserve.lookup.config",
    "LookupResult": "recserve.lookup.types",
    "LookupStats": "recserve.lookup.stats",
    "GrpcShardTransport": "recserve.lookup.transport",
    "ShardTransport": "recserve.lookup.transport",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'recserve.lookup' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
