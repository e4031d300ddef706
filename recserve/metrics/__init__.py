"""Prometheus metrics of every recserve process (docs/architecture.md §3, "Metrics").

:mod:`recserve.metrics.catalog` defines every metric once, on prometheus_client's default
registry; :mod:`recserve.metrics.collectors` reads the lookup client's and the shard's
existing counters at scrape time (no cost on the request path);
:mod:`recserve.metrics.interceptor` counts and times every RPC of a grpc.aio server;
:mod:`recserve.metrics.serve` starts a process's ``/metrics`` HTTP endpoint. Processes do
not label themselves: the scraper adds the process label from its target list.
"""
