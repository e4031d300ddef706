"""recserve.rpc.auth and its callers, without sockets (issue 17, "Security"):

* the admin token in call metadata: missing -> UNAUTHENTICATED (401), wrong ->
  PERMISSION_DENIED, no token configured -> refused unless ``--insecure-admin``, the
  deprecated ``admin_token`` field rejected; on the shard's Upsert and the ranker's and
  the cascade's Admin servicers (fake servicer contexts);
* tenants authenticated on gRPC by their API keys: a header's tenant alone is not
  trusted; the key is forwarded by RoutedCalls (a cascade's Rank calls);
* every admin caller sends metadata (send_upsert), and the launchers pass
  ``--insecure-admin`` / the ``[admin] token_env`` variable;
* ``[admin]`` / ``[tls]`` parsing.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from recserve.config.load import default_config, loads
from recserve.config.spec import TenantConfig, TlsConfig
from recserve.errors import ConfigError, InvalidArgument, PermissionDenied, Unauthenticated
from recserve.rpc.auth import CALLER_API_KEY, AdminAuth, TenantAuth, admin_metadata, bind_caller_key, forwarded_metadata, metadata_value
from recserve.rpc.status import grpc_code, http_status
from recserve.rpc.tensors import pack, unpack
from recserve.v1 import admin_pb2, embedding_pb2, ranking_pb2

TOKEN = "s3cret-admin-token"
ALPHA_KEY, BETA_KEY = "alpha-key-0123", "beta-key-4567"
TENANTS = (TenantConfig(name="alpha", api_key_env="ALPHA_KEY"), TenantConfig(name="beta", api_key_env="BETA_KEY"), TenantConfig(name="public"))


@pytest.fixture(autouse=True)
def no_bound_key() -> Any:
    """resolve() binds the key in the caller's context (a server's is its RPC's task; a
    test's is the thread's): undo it, so no test sees another's key."""
    token = CALLER_API_KEY.set("")
    yield
    CALLER_API_KEY.reset(token)


# ---- the admin token ---------------------------------------------------------------------


def test_admin_check_missing_wrong_and_right_token() -> None:
    auth = AdminAuth(TOKEN)
    with pytest.raises(Unauthenticated, match="authorization: Bearer") as missing:
        auth.check((), "Admin.ReloadModels")
    assert grpc_code(missing.value) == grpc.StatusCode.UNAUTHENTICATED and http_status(missing.value) == 401
    with pytest.raises(PermissionDenied, match="Admin.ReloadModels") as wrong:
        auth.check(admin_metadata("not-the-token"), "Admin.ReloadModels")
    assert grpc_code(wrong.value) == grpc.StatusCode.PERMISSION_DENIED and "not-the-token" not in str(wrong.value)
    with pytest.raises(PermissionDenied):  # a prefix of the token is no better than any other string
        auth.check(admin_metadata(TOKEN[:-1]), "Admin.ReloadModels")
    with pytest.raises(Unauthenticated, match="not 'Bearer"):
        auth.check((("authorization", f"Basic {TOKEN}"),), "Admin.ReloadModels")
    auth.check(admin_metadata(TOKEN), "Admin.ReloadModels")
    auth.check((("authorization", f"bearer {TOKEN}"),), "x")  # the scheme is case-insensitive (RFC 7235)
    auth.check([("other", "v"), ("authorization", f"Bearer {TOKEN}".encode())], "x")  # bytes values too


def test_without_a_token_admin_is_refused_unless_insecure() -> None:
    with pytest.raises(PermissionDenied, match=r"\$ADMIN_VAR.*--insecure-admin"):
        AdminAuth("", token_env="ADMIN_VAR").check(admin_metadata("anything"), "Admin.AddItems")
    AdminAuth("", insecure=True).check((), "Admin.AddItems")
    # --insecure-admin does not switch a configured token off.
    with pytest.raises(Unauthenticated):
        AdminAuth(TOKEN, insecure=True).check((), "Admin.AddItems")


def test_the_deprecated_request_field_is_rejected_even_with_the_right_metadata() -> None:
    with pytest.raises(InvalidArgument, match="admin_token request field is no longer read"):
        AdminAuth(TOKEN).check(admin_metadata(TOKEN), "Upsert", deprecated_field=TOKEN)


def test_from_env_reads_the_variable_token_env_names() -> None:
    env = {"RECSERVE_ADMIN_TOKEN": "default-one", "OPS_TOKEN": TOKEN}
    assert AdminAuth.from_env(env, "OPS_TOKEN").configured
    AdminAuth.from_env(env, "OPS_TOKEN").check(admin_metadata(TOKEN), "x")
    with pytest.raises(PermissionDenied):
        AdminAuth.from_env(env, "OPS_TOKEN").check(admin_metadata("default-one"), "x")
    assert not AdminAuth.from_env({}, "OPS_TOKEN").configured
    assert admin_metadata("") == () and metadata_value(admin_metadata(TOKEN), "authorization") == f"Bearer {TOKEN}"


class AbortError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class FakeContext:
    """The parts of a grpc.aio servicer context the servicers use."""

    def __init__(self, metadata: Sequence[tuple[str, str]] = ()) -> None:
        self.metadata = tuple(metadata)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    def time_remaining(self) -> float | None:
        return 10.0

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise AbortError(code, details)


def status_of(call: Any) -> AbortError:
    with pytest.raises(AbortError) as err:
        asyncio.run(call)
    return err.value


def test_shard_upsert_checks_the_metadata_before_anything_else() -> None:
    from embedding_server.fault import FaultInjector
    from embedding_server.service import EmbeddingShardService

    def service(admin: AdminAuth | None) -> EmbeddingShardService:
        return EmbeddingShardService(shard_id=3, plan_version=1, plan_json="{}", executor=ThreadPoolExecutor(1), faults=FaultInjector(enabled=False), admin=admin)

    req = embedding_pb2.UpsertRequest()
    assert status_of(service(AdminAuth(TOKEN)).Upsert(req, FakeContext())).code == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[arg-type]
    wrong = status_of(service(AdminAuth(TOKEN)).Upsert(req, FakeContext(admin_metadata("nope"))))  # type: ignore[arg-type]
    assert wrong.code == grpc.StatusCode.PERMISSION_DENIED and "shard 3" in wrong.details
    # The default (no token, not insecure) refuses even a caller that sends one.
    assert status_of(service(None).Upsert(req, FakeContext(admin_metadata(TOKEN)))).code == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[arg-type]
    old = embedding_pb2.UpsertRequest(admin_token=TOKEN)
    assert status_of(service(AdminAuth(TOKEN)).Upsert(old, FakeContext(admin_metadata(TOKEN)))).code == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[arg-type]
    # Past the check: the shard is still loading (no core), so UNAVAILABLE, not a refusal.
    assert status_of(service(AdminAuth(TOKEN)).Upsert(req, FakeContext(admin_metadata(TOKEN)))).code == grpc.StatusCode.UNAVAILABLE  # type: ignore[arg-type]
    assert status_of(service(AdminAuth("", insecure=True)).Upsert(req, FakeContext())).code == grpc.StatusCode.UNAVAILABLE  # type: ignore[arg-type]


@pytest.mark.parametrize("server", ["ranker", "cascade"])
def test_admin_servicers_refuse_before_they_look_at_the_process(server: str) -> None:
    from recserve.rpc.serving import Slot

    cluster = default_config()
    if server == "ranker":
        from ranker.server import AdminServicer as RankerAdmin
        from ranker.server import RankerProcessConfig

        def make(token: str, insecure: bool = False) -> Any:
            return RankerAdmin(Slot("ranker"), RankerProcessConfig(cluster, "m", ("a:1",), admin_token=token, insecure_admin=insecure))

        calls: list[tuple[str, Any]] = [("ReloadModels", admin_pb2.ReloadModelsRequest(models_dir="x")), ("AddItems", admin_pb2.AddItemsRequest())]
    else:
        from cascade.server import AdminServicer as CascadeAdmin
        from cascade.server import CascadeProcessConfig

        def make(token: str, insecure: bool = False) -> Any:
            return CascadeAdmin(Slot("cascade"), CascadeProcessConfig(cluster, "m", ("a:1",), (), admin_token=token, insecure_admin=insecure))

        calls = [("RefreshIndex", admin_pb2.RefreshIndexRequest()), ("AddItems", admin_pb2.AddItemsRequest())]
    for method, request in calls:
        assert status_of(getattr(make(TOKEN), method)(request, FakeContext())).code == grpc.StatusCode.UNAUTHENTICATED
        denied = status_of(getattr(make(TOKEN), method)(request, FakeContext(admin_metadata("nope"))))
        assert denied.code == grpc.StatusCode.PERMISSION_DENIED and f"Admin.{method}" in denied.details
        assert status_of(getattr(make(""), method)(request, FakeContext(admin_metadata(TOKEN)))).code == grpc.StatusCode.PERMISSION_DENIED
        request.admin_token = TOKEN  # the deprecated field
        assert status_of(getattr(make(TOKEN), method)(request, FakeContext(admin_metadata(TOKEN)))).code == grpc.StatusCode.INVALID_ARGUMENT
        request.admin_token = ""
        for ok in (make(TOKEN), make("", insecure=True)):  # allowed: the slot is empty, so UNAVAILABLE
            assert status_of(getattr(ok, method)(request, FakeContext(admin_metadata(TOKEN)))).code == grpc.StatusCode.UNAVAILABLE


# ---- tenants on gRPC ---------------------------------------------------------------------


def tenant_auth(keys: dict[str, str] | None = None) -> TenantAuth:
    return TenantAuth(TENANTS, {"alpha": ALPHA_KEY, "beta": BETA_KEY} if keys is None else keys)


def test_a_key_decides_the_tenant_and_a_header_alone_is_not_trusted() -> None:
    auth = tenant_auth()
    key = "x-api-key"
    assert auth.resolve(((key, ALPHA_KEY),), "") == auth.resolve(((key, ALPHA_KEY),), "default") == auth.resolve(((key, ALPHA_KEY),), "alpha") == "alpha"
    assert auth.resolve(((key, BETA_KEY),), "beta") == "beta"
    with pytest.raises(Unauthenticated, match="tenant 'alpha' needs its API key") as claimed:
        auth.resolve((), "alpha")
    assert grpc_code(claimed.value) == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(PermissionDenied, match="'beta'"):
        auth.resolve(((key, ALPHA_KEY),), "beta")  # alpha's key, claiming beta
    with pytest.raises(Unauthenticated, match="matches no tenant") as wrong:
        auth.resolve(((key, "guess"),), "alpha")
    assert "guess" not in str(wrong.value)
    # Without a key: the key-less tenant only (not an undeclared name either).
    assert auth.resolve((), "") == auth.resolve((), "default") == auth.resolve((), "public") == "public"
    with pytest.raises(Unauthenticated):
        auth.resolve((), "someone-else")


def test_without_a_keyless_tenant_a_keyless_call_is_refused_and_unknown_keys_never_match() -> None:
    auth = TenantAuth(TENANTS[:2], {"alpha": ALPHA_KEY})  # beta's variable is unset in this process
    with pytest.raises(Unauthenticated, match="a request without a tenant"):
        auth.resolve((), "")
    with pytest.raises(Unauthenticated):
        auth.resolve((("x-api-key", ""),), "beta")
    with pytest.raises(Unauthenticated):
        auth.resolve((("x-api-key", BETA_KEY),), "beta")  # not known here: refused, never served as someone
    assert auth.resolve((("x-api-key", ALPHA_KEY),), "") == "alpha"


def test_no_keyed_tenant_passes_the_header_as_before() -> None:
    assert TenantAuth(None).resolve((), "acme") == "acme"
    assert TenantAuth(None).resolve((), "") == "default"
    assert TenantAuth((TenantConfig(name="default"),)).resolve((("x-api-key", "k"),), "globex") == "globex"


def test_from_cluster_reads_the_keys_and_the_header_name() -> None:
    spec = default_config()
    import dataclasses

    from recserve.config.spec import GatewayConfig

    cluster = dataclasses.replace(spec, tenants=TENANTS, gateway=GatewayConfig(api_key_header="X-Feed-Key"))
    auth = TenantAuth.from_cluster(cluster, {"ALPHA_KEY": ALPHA_KEY})
    assert auth.resolve((("x-feed-key", ALPHA_KEY),), "alpha") == "alpha"
    with pytest.raises(Unauthenticated):
        auth.resolve((("x-api-key", ALPHA_KEY),), "alpha")  # another metadata name: no key came


def test_resolve_binds_the_key_for_the_calls_made_on_its_behalf() -> None:
    auth = tenant_auth()

    def serve_one(key: str) -> tuple[tuple[str, str], ...]:
        auth.resolve((("x-api-key", key),), "")
        return forwarded_metadata()

    # Each call in its own context (as each gRPC call runs in its own task): none leaks.
    assert contextvars.copy_context().run(serve_one, ALPHA_KEY) == (("x-api-key", ALPHA_KEY),)
    assert contextvars.copy_context().run(serve_one, BETA_KEY) == (("x-api-key", BETA_KEY),)
    assert forwarded_metadata() == () and CALLER_API_KEY.get() == ""

    def bind_nothing() -> tuple[tuple[str, str], ...]:
        bind_caller_key("")
        return forwarded_metadata()

    assert contextvars.copy_context().run(bind_nothing) == ()


class RecordingRank:
    """A Ranking stub's Rank recording each call's metadata."""

    def __init__(self) -> None:
        self.metadata: list[Any] = []

    def Rank(self, request: ranking_pb2.RankRequest, timeout: float | None = None, metadata: Any = None) -> Any:
        self.metadata.append(metadata)
        ids = unpack(request.candidate_ids, "candidate_ids")

        async def answer() -> ranking_pb2.RankResponse:
            return ranking_pb2.RankResponse(item_ids=pack(ids), scores=pack(np.zeros(ids.shape[0], np.float32)), model_version="m", model="dlrm")

        return answer()


def test_routed_calls_forward_the_callers_key_else_their_own() -> None:
    from recserve.client.ranking import RankingClient

    stub = RecordingRank()

    async def body(api_key: str, caller_key: str) -> None:
        async with RankingClient(["r:1"], stub_factory=lambda a: stub, api_key=api_key) as client:
            bind_caller_key(caller_key)
            await client.rank(1, np.array([3, 4], np.int64), timeout_s=5.0)

    asyncio.run(body("", ""))
    asyncio.run(body("own-key", ""))
    asyncio.run(body("own-key", ALPHA_KEY))
    assert stub.metadata == [None, (("x-api-key", "own-key"),), (("x-api-key", ALPHA_KEY),)]


# ---- callers send metadata -----------------------------------------------------------------


def test_send_upsert_puts_the_token_in_metadata_not_in_the_request() -> None:
    from recserve.lookup.upsert import send_upsert
    from recserve.rpc.deadline import make_header
    from tests.unit.test_lookup_fakes import FakeShards, make_plan, make_weights

    plan, _ = make_plan()
    transport = FakeShards(plan, make_weights())
    ids = np.array([0, 1, 1999], np.int64)  # hot ids have several owners: one call each
    rows = np.ones((3, 16), np.float32)
    asyncio.run(send_upsert(transport, plan, "item", ids, rows, header=make_header(timeout_s=5), admin_token=TOKEN, timeout_s=5))  # type: ignore[arg-type]
    assert transport.upserts and all(not r.admin_token for _, r in transport.upserts)
    assert transport.upsert_metadata == [(("authorization", f"Bearer {TOKEN}"),)] * len(transport.upserts)


def test_launchers_pass_insecure_admin_and_the_token_variable(tmp_path: Path) -> None:
    from recserve.cluster import ShardCluster
    from recserve.cluster.cascade import CascadeCluster
    from recserve.cluster.rankers import RankerCluster

    shards = ShardCluster(tmp_path / "plan.json", tmp_path / "d", num_shards=1, admin_token="tok", token_env="OPS_TOKEN", insecure_admin=False)
    argv = shards._command(0, 0, tmp_path / "p")
    assert argv[argv.index("--admin-token-env") + 1] == "OPS_TOKEN" and "--insecure-admin" not in argv and "tok" not in argv
    assert shards._env()["OPS_TOKEN"] == "tok"
    plain = ShardCluster(tmp_path / "plan.json", tmp_path / "d", num_shards=1, insecure_admin=True)
    assert "--insecure-admin" in plain._command(0, 0, tmp_path / "p") and "--admin-token-env" not in plain._command(0, 0, tmp_path / "p")
    rankers = RankerCluster(tmp_path / "c.toml", tmp_path / "m", ["a:1"], data_root=tmp_path / "r", insecure_admin=True, admin_token="t2", token_env="OPS_TOKEN")
    assert "--insecure-admin" in rankers._command(0, 0, tmp_path / "p") and rankers._env()["OPS_TOKEN"] == "t2"
    cascade = CascadeCluster(tmp_path / "c.toml", tmp_path / "m", ["a:1"], ["s:1"], data_root=tmp_path / "c")
    assert "--insecure-admin" not in cascade._command(0, 0, tmp_path / "p")
    # [tls]: the launchers watch their children's health over TLS.
    from recserve.cluster.group import health_watch, watch_health

    assert health_watch(None) is health_watch(TlsConfig()) is watch_health and health_watch(TlsConfig("c.pem", "k.pem")) is not watch_health


# ---- [admin] and [tls] ----------------------------------------------------------------------

BASE = """
[[tables]]
name = "item"
rows = 100
dim = 8

[[features]]
name = "item_id"
table = "item"
"""


def test_admin_and_tls_sections_parse_and_validate(tmp_path: Path) -> None:
    cluster = loads(BASE)
    assert cluster.admin.token_env == "RECSERVE_ADMIN_TOKEN" and not cluster.tls.enabled
    cluster = loads(BASE + '[admin]\ntoken_env = "OPS_TOKEN"\n[tls]\ncert_file = "c.pem"\nkey_file = "k.pem"\nca_file = "ca.pem"\n')
    assert cluster.admin.token_env == "OPS_TOKEN" and cluster.tls == TlsConfig("c.pem", "k.pem", "ca.pem") and cluster.tls.enabled
    with pytest.raises(ConfigError, match="admin.token_env"):
        loads(BASE + '[admin]\ntoken_env = "not a name"\n')
    with pytest.raises(ConfigError, match="tls.cert_file / tls.key_file"):
        loads(BASE + '[tls]\ncert_file = "c.pem"\n')
    with pytest.raises(ConfigError, match="tls.ca_file"):
        loads(BASE + '[tls]\nca_file = "ca.pem"\n')
    with pytest.raises(ConfigError, match="tls.nope"):
        loads(BASE + '[tls]\nnope = 1\n')
    from recserve.rpc.auth import server_credentials

    with pytest.raises(ConfigError, match=r"tls.key_file = .*missing.pem.* cannot be read"):
        server_credentials(TlsConfig(str(tmp_path / "c.pem"), str(tmp_path / "missing.pem")))
