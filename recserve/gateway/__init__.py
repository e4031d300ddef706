"""The HTTP gateway (docs/architecture.md §3, "The HTTP gateway"): aiohttp in front of the cascade and the
rankers, with request schemas and their OpenAPI document, tenants (API keys, quotas),
deadlines, the status page and ``/metrics``.

Modules: ``schemas`` (the bodies, as data), ``validate`` (bodies -> typed values),
``openapi`` (the document), ``tenants`` (auth and quotas, no I/O), ``app`` (the aiohttp
application), ``server`` (the ``recserve gateway serve`` process), ``status`` (the
status page).
"""
