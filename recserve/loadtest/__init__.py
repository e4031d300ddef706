"""``recserve loadtest``: open-loop load tests of a running cluster (docs/architecture.md §11, "Load testing").

* :mod:`~recserve.loadtest.schedule` — the open-loop send schedule and the generator's
  lag (a pure state machine, fake-clock tested);
* :mod:`~recserve.loadtest.record` — outcomes, errors by status, the HDR latency
  histogram, the report (:class:`~recserve.loadtest.record.LoadSummary`);
* :mod:`~recserve.loadtest.requests` — requests drawn from the catalog;
* :mod:`~recserve.loadtest.targets` — recommend / rank / lookup over gRPC, recommend /
  rank over HTTP;
* :mod:`~recserve.loadtest.driver` — the asyncio edge: send on schedule, record, drain;
* :mod:`~recserve.loadtest.sweeps` — the knee (``--sweep-rate``) and the
  accumulation-window sweep (``--sweep-window``);
* :mod:`~recserve.loadtest.discover` — the addresses of a running ``recserve serve``.
"""
