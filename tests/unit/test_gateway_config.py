"""[gateway] and [[tenants]] in the cluster spec: the fields the HTTP gateway reads, each
refused with a message naming the field, the value and the fix."""

from __future__ import annotations

import pytest

from recserve.config import DEFAULT_SPEC, loads
from recserve.errors import ConfigError

BASE = '[[tables]]\nname = "t"\nrows = 10\ndim = 4\n\n'


def test_gateway_and_tenant_fields_parse() -> None:
    cluster = loads(BASE + """[gateway]
host = "0.0.0.0"
port = 8081
timeout_ms = 250.0
max_body_bytes = 65536
max_concurrency = 64
api_key_header = "X-Tenant-Key"

[[tenants]]
name = "feed"
api_key_env = "FEED_API_KEY"
rate_per_s = 100
burst = 20
max_concurrent_requests = 8

[[tenants]]
name = "public"
rate_per_s = 5.0
""")
    gw = cluster.gateway
    assert (gw.host, gw.port, gw.timeout_ms, gw.max_body_bytes, gw.max_concurrency, gw.api_key_header) == ("0.0.0.0", 8081, 250.0, 65536, 64, "X-Tenant-Key")
    feed, public = cluster.tenants
    assert (feed.api_key_env, feed.rate_per_s, feed.burst, feed.max_concurrent_requests, feed.bucket_size) == ("FEED_API_KEY", 100.0, 20.0, 8, 20.0)
    assert public.api_key_env == "" and public.bucket_size == 5.0


def test_the_embedded_default_has_one_keyless_default_tenant() -> None:
    cluster = loads(DEFAULT_SPEC)
    assert [(t.name, t.api_key_env) for t in cluster.tenants] == [("default", "")]


@pytest.mark.parametrize("text, field, value, fix", [
    ("[gateway]\ntimeout_ms = 0\n", "gateway.timeout_ms", "0", "(0, 600000]"),
    ("[gateway]\nmax_body_bytes = 10\n", "gateway.max_body_bytes", "10", "1024.."),
    ("[gateway]\nmax_concurrency = 0\n", "gateway.max_concurrency", "0", "1..1000000"),
    ("[gateway]\napi_key_header = \"X Key\"\n", "gateway.api_key_header", "X Key", "header name"),
    ("[[tenants]]\nname = \"a\"\napi_key_env = \"BAD-NAME\"\n", "tenants.a.api_key_env", "BAD-NAME", "environment variable"),
    ("[[tenants]]\nname = \"a\"\nburst = -1\n", "tenants.a.burst", "-1", ">= 0"),
    ("[[tenants]]\nname = \"a\"\nmax_concurrent_requests = -2\n", "tenants.a.max_concurrent_requests", "-2", ">= 0"),
    ("[[tenants]]\nname = \"a b\"\n", "tenants[].name", "a b", "letters"),
    ("[[tenants]]\nname = \"a\"\n\n[[tenants]]\nname = \"b\"\n", "tenants[].api_key_env", "['a', 'b']", "but one"),
    ("[[tenants]]\nname = \"a\"\napi_key_env = \"K_KEY\"\n\n[[tenants]]\nname = \"b\"\napi_key_env = \"K_KEY\"\n", "tenants[].api_key_env", "K_KEY", "its own"),
])  # fmt: skip
def test_bad_gateway_and_tenant_values_are_refused_naming_them(text: str, field: str, value: str, fix: str) -> None:
    with pytest.raises(ConfigError) as err:
        loads(BASE + text)
    assert field in err.value.message and value in err.value.message and fix in err.value.message, err.value.message
