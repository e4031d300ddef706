"""Who may call: the admin token, tenants' API keys on gRPC, and optional TLS.

Synchronous checks with no I/O (the servicers pass in their call's metadata), so they
are unit-tested without sockets; the credentials helpers at the bottom only read files.

* **Admin operations** (the shard's ``Upsert``; ``Admin.ReloadModels``,
  ``RefreshIndex``, ``AddItems``) need ``authorization: Bearer <token>`` in call
  metadata, the token being the value of the environment variable ``[admin] token_env``
  names (``RECSERVE_ADMIN_TOKEN`` by default). :class:`AdminAuth`: no token sent →
  UNAUTHENTICATED (HTTP 401); a wrong one → PERMISSION_DENIED; the comparison is
  constant-time (SHA-256 digests through ``hmac.compare_digest``, so neither the
  token's length nor its prefix shows in the time taken). A process started without a
  token refuses every admin operation (PERMISSION_DENIED naming the variable) unless
  it was started with ``--insecure-admin``. The old ``admin_token`` request field is
  deprecated and rejected (INVALID_ARGUMENT) when set: a client still sending it gets
  told where the token goes now, instead of a puzzling UNAUTHENTICATED.
* **Tenants on gRPC** (:class:`TenantAuth`) are authenticated by the gateway's API keys
  (``[[tenants]] api_key_env``, checked the way
  :class:`recserve.gateway.tenants.TenantTable` checks them), sent in call metadata under the
  gateway's header name in lower case (``x-api-key``). The header's ``tenant`` string
  alone is not trusted: claiming a keyed tenant without its key is UNAUTHENTICATED; a
  key decides the tenant, and a header naming another one is PERMISSION_DENIED. The
  gateway forwards the key it authenticated, and every server forwards the key of the
  call it is serving to the calls it makes for it (:data:`CALLER_API_KEY`, read by
  :class:`recserve.client.routed.RoutedCalls`), so a cascade's Rank calls carry the
  tenant's key to the rankers.
* **TLS** (``[tls] cert_file``, ``key_file``, ``ca_file``): :func:`add_listening_port`
  binds a gRPC server with or without it; :func:`channel_credentials` and the two SSL
  contexts serve clients and the HTTP gateway.

Example::

    admin = AdminAuth.from_env(os.environ, cluster.admin.token_env, insecure=args.insecure_admin)
    admin.check(context.invocation_metadata(), "Admin.ReloadModels", request.admin_token)
    stub.ReloadModels(request, metadata=admin_metadata(token))
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import ssl
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from recserve.config.spec import AdminConfig, ClusterConfig, TenantConfig, TlsConfig
from recserve.errors import ConfigError, InvalidArgument, PermissionDenied, Unauthenticated
from recserve.logs import register_secret

AUTHORIZATION = "authorization"  # gRPC metadata keys are lower case
BEARER = "bearer "
DEFAULT_TOKEN_ENV = AdminConfig.token_env  # launchers and `recserve shard serve` keep this name
INSECURE_ADMIN_FLAG = "--insecure-admin"
DEFAULT_API_KEY_METADATA = "x-api-key"

# The API key of the call this task serves ("" = none): set by the gateway once it has
# authenticated a request and by servers from their incoming metadata; every outgoing
# routed call made on the request's behalf forwards it (a contextvar, so concurrent
# requests never see each other's key).
CALLER_API_KEY: contextvars.ContextVar[str] = contextvars.ContextVar("recserve_caller_api_key", default="")
CALLER_API_KEY_METADATA: contextvars.ContextVar[str] = contextvars.ContextVar("recserve_caller_api_key_metadata", default=DEFAULT_API_KEY_METADATA)

Metadata = Iterable[tuple[str, str | bytes]] | None


def metadata_value(metadata: Metadata, key: str) -> str | None:
    """The first value of ``key`` (lower case) in a call's metadata, or None."""
    for k, v in metadata or ():
        if k == key:
            return v.decode("utf-8", "replace") if isinstance(v, bytes) else v
    return None


def admin_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata carrying ``token`` to an admin operation (none for ``""``)."""
    return ((AUTHORIZATION, f"Bearer {token}"),) if token else ()


def forwarded_metadata() -> tuple[tuple[str, str], ...]:
    """The metadata an outgoing call made for the current request carries: the caller's
    API key (see :data:`CALLER_API_KEY`), or nothing."""
    key = CALLER_API_KEY.get()
    return ((CALLER_API_KEY_METADATA.get(), key),) if key else ()


def bind_caller_key(key: str, metadata_key: str = DEFAULT_API_KEY_METADATA) -> None:
    """Bind the authenticated API key of the request this task serves, for the calls
    made on its behalf (:func:`forwarded_metadata`); ``""`` binds nothing."""
    if key:
        CALLER_API_KEY.set(key)
        CALLER_API_KEY_METADATA.set(metadata_key)


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


class AdminAuth:
    """The admin check of one process (module docstring). ``token`` is held only as
    its digest; ``token_env`` names the variable in messages (never the value)."""

    def __init__(self, token: str, *, token_env: str = DEFAULT_TOKEN_ENV, insecure: bool = False) -> None:
        self._digest = _digest(token) if token else None
        self.token_env = token_env
        self.insecure = insecure

    @classmethod
    def from_env(cls, environ: Mapping[str, str], token_env: str = DEFAULT_TOKEN_ENV, *, insecure: bool = False) -> AdminAuth:
        return cls(environ.get(token_env, ""), token_env=token_env, insecure=insecure)

    @property
    def configured(self) -> bool:
        return self._digest is not None

    def check(self, metadata: Metadata, what: str, deprecated_field: str = "") -> None:
        """Pass, or raise: InvalidArgument when the deprecated ``admin_token`` request
        field is set; PermissionDenied when this process has no token and is not
        ``--insecure-admin``; Unauthenticated when no ``authorization: Bearer`` came;
        PermissionDenied when the token differs. ``what`` names the operation."""
        if deprecated_field:
            raise InvalidArgument(f"{what}: the admin_token request field is no longer read; send the token as call metadata 'authorization: Bearer <token>'")
        if self._digest is None:
            if self.insecure:
                return
            raise PermissionDenied(f"{what} is refused: this process has no admin token (set ${self.token_env}, the variable [admin] token_env names) "
                                   f"and was not started with {INSECURE_ADMIN_FLAG}")  # fmt: skip
        header = metadata_value(metadata, AUTHORIZATION)
        if not header:
            raise Unauthenticated(f"{what} needs the admin token: send call metadata 'authorization: Bearer <token>' (the value of ${self.token_env})")
        if not header[: len(BEARER)].lower() == BEARER:
            raise Unauthenticated(f"{what}: the authorization metadata is not 'Bearer <token>'")
        if not hmac.compare_digest(_digest(header[len(BEARER) :].strip()), self._digest):
            raise PermissionDenied(f"{what}: the admin token in the authorization metadata is not this process's (${self.token_env})")


class TenantAuth:
    """Which tenant a gRPC call is from (module docstring).

    With no keyed tenant the header's ``tenant`` passes as it is: there is no key to
    check it against, and every caller is equally anonymous. With keyed tenants: a key
    decides the tenant (a header naming another one is PermissionDenied); without a key,
    only the key-less tenant (header ``""``, ``"default"`` or its name) is served, and a
    keyed tenant's name is Unauthenticated. A keyed tenant whose variable is unset in
    this process can never authenticate here (its key is not known), but the process
    still starts: only the gateway must hold every key.
    """

    def __init__(self, tenants: Sequence[TenantConfig] | None, keys: Mapping[str, str] | None = None, *,
                 metadata_key: str = DEFAULT_API_KEY_METADATA) -> None:  # fmt: skip
        """``tenants``: the spec's (None or no keyed one: no checks); ``keys``: tenant
        name -> its key, as far as this process knows them (held as digests only)."""
        keys = keys or {}
        tenants = tuple(tenants or ())
        self.metadata_key = metadata_key
        self.enabled = any(t.api_key_env for t in tenants)
        self._keyed_names = frozenset(t.name for t in tenants if t.api_key_env)
        keyless = [t.name for t in tenants if not t.api_key_env]
        self.keyless: str | None = keyless[0] if keyless else None
        self._digests: tuple[tuple[bytes, str], ...] = tuple((_digest(keys[n]), n) for n in sorted(self._keyed_names) if keys.get(n))

    @classmethod
    def from_cluster(cls, cluster: ClusterConfig, environ: Mapping[str, str]) -> TenantAuth:
        keys = {t.name: environ.get(t.api_key_env, "") for t in cluster.tenants if t.api_key_env}
        # Their variables may have any name: mask the values in every log line (as the gateway does).
        register_secret(*(k for k in keys.values() if k))
        return cls(cluster.tenants, keys, metadata_key=cluster.gateway.api_key_header.lower())

    def _tenant_of(self, key: str) -> str | None:
        presented = _digest(key)
        found: str | None = None
        for want, name in self._digests:  # every tenant, always: no early exit
            if hmac.compare_digest(presented, want):
                found = name
        return found

    def resolve(self, metadata: Metadata, claimed: str) -> str:
        """The authenticated tenant name of a call whose header says ``claimed``; binds
        the presented key (if any) as :data:`CALLER_API_KEY` for the calls made on its
        behalf (the caller's context: each gRPC call runs in its own task)."""
        if not self.enabled:
            return claimed or "default"
        key = metadata_value(metadata, self.metadata_key)
        if key:
            tenant = self._tenant_of(key)
            if tenant is None:
                raise Unauthenticated(f"the API key in the {self.metadata_key} metadata matches no tenant")
            if claimed not in ("", "default", tenant):
                raise PermissionDenied(f"the API key in the {self.metadata_key} metadata is another tenant's than the header's tenant {claimed!r}")
            bind_caller_key(key, self.metadata_key)
            return tenant
        keyless = self.keyless
        if claimed in self._keyed_names or keyless is None or claimed not in ("", "default", keyless):
            who = f"tenant {claimed!r}" if claimed else "a request without a tenant"
            raise Unauthenticated(f"{who} needs its API key: send it in the {self.metadata_key} call metadata")
        return keyless


# ---- TLS --------------------------------------------------------------------------------


def _read(field: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{field} = {path!r} cannot be read ({exc.strerror}); give a PEM file") from None


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """gRPC server credentials presenting ``cert_file`` / ``key_file``."""
    return grpc.ssl_server_credentials([(_read("tls.key_file", tls.key_file), _read("tls.cert_file", tls.cert_file))])


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """gRPC channel credentials verifying servers against ``ca_file`` (system roots when
    empty)."""
    return grpc.ssl_channel_credentials(root_certificates=_read("tls.ca_file", tls.ca_file) if tls.ca_file else None)


def add_listening_port(server: grpc.aio.Server | Any, address: str, tls: TlsConfig | None) -> int:
    """Bind ``address`` with TLS when ``tls`` is enabled, else plaintext; the port."""
    if tls is not None and tls.enabled:
        return int(server.add_secure_port(address, server_credentials(tls)))
    return int(server.add_insecure_port(address))


def open_channel(address: str, tls: TlsConfig | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """An asyncio channel to ``address``, over TLS when ``tls`` is enabled."""
    if tls is not None and tls.enabled:
        return grpc.aio.secure_channel(address, channel_credentials(tls), options=list(options))
    return grpc.aio.insecure_channel(address, options=list(options))


def server_ssl_context(tls: TlsConfig) -> ssl.SSLContext | None:
    """The HTTP gateway's server-side SSL context (None = plaintext)."""
    if not tls.enabled:
        return None
    _read("tls.cert_file", tls.cert_file)  # a clear ConfigError before ssl's own
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls.cert_file, tls.key_file)
    return context


def client_ssl_context(tls: TlsConfig) -> ssl.SSLContext:
    """An HTTPS client context verifying the gateway against ``ca_file``."""
    return ssl.create_default_context(cafile=tls.ca_file or None)


__all__ = [
    "AUTHORIZATION", "CALLER_API_KEY", "DEFAULT_TOKEN_ENV", "INSECURE_ADMIN_FLAG", "AdminAuth", "TenantAuth", "add_listening_port", "admin_metadata", "bind_caller_key",
    "channel_credentials", "client_ssl_context", "forwarded_metadata", "metadata_value", "open_channel", "server_credentials", "server_ssl_context",
]  # fmt: skip
