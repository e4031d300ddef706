"""generation: the LLM decode engine on the shared scheduler core (docs/architecture.md §6).

- :mod:`generation.config` — ModelConfig, KvCacheConfig, ContinuousBatchConfig, GenerationConfig;
- :mod:`generation.tokenizer` — the byte-level tokenizer;
- :mod:`generation.model` — a small decoder-only transformer (full and paged forward);
- :mod:`generation.blocks` / :mod:`generation.kv_cache` — block bookkeeping (refcounts,
  copy-on-write prefix cache keyed by tenant and model version) and the physical pool;
- :mod:`generation.policy` — :class:`ContinuousBatchPolicy`, registered as
  ``PolicyKind.CONTINUOUS``; :mod:`generation.static_policy` — the static-batching baseline;
- :mod:`generation.engine` — the batch runner and :func:`build`;
- :mod:`generation.oracle` — naive full-recompute decoding;
- :mod:`generation.train` — training on templated catalog text, checkpoints.

Imports only core recserve packages (never the rankers, the cascade or the CLI). Importing
this package does not import torch; the modules that need it do.
"""
