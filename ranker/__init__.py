"""ranker layer (docs/architecture.md §2, §7): the three models, trained without the ground truth.

Modules: ``scrubbed`` (the only catalog view training gets: no latent vectors, no
click-model popularity, no seeds), ``features`` (log counts, dense rows, jagged sparse
features, all as arrays), ``models/`` (``dlrm`` — ``torchrec.models.dlrm.DLRM``;
``two_tower``; ``l3`` — attention over unpooled history rows), ``optim`` (row-sparse
Adam), ``train``, ``scoring`` (in-process batch scoring), ``evaluate`` (the only module
that reads the ground truth), ``export`` (MODELS with one ``model_version``),
``serving`` (version-checked loading for the Ranking service), ``spec`` (the cluster
spec of an export) and ``pipeline`` (train -> evaluate -> export, for ``recserve train``).

Nothing here is imported by ``recserve --help``; torch loads with the model modules.
"""
