"""The three models: ``dlrm`` (torchrec DLRM), ``two_tower``, ``l3`` (attention reranker),
plus tensor helpers shared by them (``common``)."""
