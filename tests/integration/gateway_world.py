"""A whole serving stack behind the HTTP gateway, on the tiny trained world of
tests/integration/ranker_world.py, for the gateway, client, log and status-page tests.

``start_gateway_world`` starts 2 shards, 1 ranker, the cascade and the gateway (each a
real process on loopback, with its Prometheus ``/metrics``), all reading one spec: the
world's, with :data:`CASCADE` (small stages, a generous deadline) and ``extra`` TOML
appended. ``extra`` sections replace the generated ones of the same name; if ``extra``
declares any ``[[tenants]]``, those are the whole tenant list (the generated key-less
``default`` is dropped). ``env`` reaches the gateway, the rankers, the cascade and the
generators (tenant keys: ``[[tenants]] api_key_env``; the gRPC servers authenticate
tenants by the same keys); ``admin_token`` reaches every process as ``RECSERVE_ADMIN_TOKEN``.

Use one per test module (training the world takes a while)::

    @pytest.fixture(scope="module")
    def gw(tmp_path_factory) -> Iterator[GatewayWorld]:
        with gateway_world(tmp_path_factory.mktemp("gw"), extra=TENANTS, env={"FEED_KEY": KEY}) as world:
            yield world

    requests.post(gw.url + "/v1/recommendations", json={"user_id": 5, "k": 10})
    gw.metrics_urls      # {"shard-0": "http://127.0.0.1:P/metrics", ..., "gateway": ...}
    gw.log_paths         # {"shard-0": Path(...), ..., "gateway": Path(...)}
    assert secrets_in(read_logs(gw.log_paths), {"feed key": KEY}) == []  # the no-secrets check
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path

from recserve.cluster import ShardCluster
from recserve.cluster.cascade import CascadeCluster
from recserve.cluster.gateway import GatewayCluster
from recserve.cluster.generation import GenerationCluster
from recserve.cluster.rankers import RankerCluster
from recserve.logs import secrets_in  # noqa: F401 (the shared no-secrets check, re-exported for the suites)
from tests.integration.ranker_world import RankerWorld, make_ranker_world, spec_text

# Small stages for the tiny catalog (5,000 items) and a deadline a loaded 2-core box meets.
CASCADE = """[cascade]
l0_out = 400
l1_out = 200
l2_out = 50
l3_out = 10
default_deadline_ms = 5000.0
index_factory = "Flat"
"""
GATEWAY = """[gateway]
timeout_ms = 10000.0
"""
DEFAULT_TENANT = '[[tenants]]\nname = "default"\n'


@dataclasses.dataclass
class GatewayWorld:
    """The running stack. ``stop()`` stops everything (gateway first)."""

    world: RankerWorld
    spec_path: Path
    shards: ShardCluster
    rankers: RankerCluster
    cascade: CascadeCluster
    gateway: GatewayCluster
    generation: GenerationCluster | None = None  # with ``generators=N``: the spec needs a [generation] section

    @property
    def url(self) -> str:
        """The gateway's ``http://HOST:PORT``."""
        return self.gateway.url

    @property
    def recommenders(self) -> list[str]:
        return [self.cascade.address]

    @property
    def ranker_addresses(self) -> list[str]:
        return list(self.rankers.addresses)

    @property
    def shard_addresses(self) -> list[str]:
        return list(self.shards.addresses)

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Every process's ``/metrics`` URL by name (``shard-0``, ``ranker-0``, ``cascade-0``, ``gateway``)."""
        return {**_stack_metrics(self.shards, self.rankers, self.cascade), "gateway": self.gateway.metrics_url}

    @property
    def log_paths(self) -> dict[str, Path]:
        """Every process's log file by the same names."""
        paths = {f"shard-{k}": self.shards.log_path(k) for k in range(self.shards.num_shards)}
        paths |= {f"ranker-{k}": self.rankers.log_path(k) for k in range(self.rankers.num_rankers)}
        return paths | {"cascade-0": self.cascade.log_path, "gateway": self.gateway.log_path}

    def stop(self) -> None:
        errors = []
        for launcher in (self.gateway, self.cascade, self.generation, self.rankers, self.shards):
            if launcher is None:
                continue
            try:
                launcher.stop()
            except Exception as exc:  # one failure must not leave the others running
                errors.append(exc)
        if errors:
            raise errors[0]


def read_logs(paths: Mapping[str, Path]) -> dict[str, str]:
    """Every log's text by process name (``GatewayWorld.log_paths`` or any such map)."""
    return {name: path.read_text(errors="replace") for name, path in paths.items()}


def _stack_metrics(shards: ShardCluster, rankers: RankerCluster, cascade: CascadeCluster) -> dict[str, str]:
    urls = {f"shard-{k}": shards.metrics_url(k) for k in range(shards.num_shards)}
    urls |= {f"ranker-{k}": rankers.metrics_url(k) for k in range(rankers.num_rankers)}
    urls["cascade-0"] = cascade.metrics_url
    return {name: url for name, url in urls.items() if url is not None}


def world_spec(world: RankerWorld, extra: str = "") -> str:
    """The world's spec with CASCADE and GATEWAY (unless ``extra`` has its own) and ``extra``."""
    lines = set(extra.splitlines())
    base = "".join(section for section in (CASCADE, GATEWAY) if section.splitlines()[0] not in lines)
    text = spec_text(world.export.manifest, world.models, base + "\n" + extra)
    if "[[tenants]]" in lines:
        assert DEFAULT_TENANT in text, "the generated spec no longer declares the default tenant this way"
        text = text.replace(DEFAULT_TENANT, "", 1)
    return text


def start_gateway_world(
    root: Path,
    *,
    extra: str = "",
    env: Mapping[str, str] | None = None,
    admin_token: str = "",
    world: RankerWorld | None = None,
    fault_hook: bool = False,
    gateway_args: tuple[str, ...] = (),
    generators: int = 0,
) -> GatewayWorld:
    """Start the stack under ``root`` (see the module docstring); every process SERVING
    and the gateway's ``/readyz`` 200 when it returns. ``world``: reuse a trained one;
    ``fault_hook``: the shards accept injected faults (embedding_server.fault);
    ``generators``: that many generation replicas behind the gateway too."""
    world = world or make_ranker_world(root / "world")
    spec = root / "gateway-world.toml"
    spec.write_text(world_spec(world, extra))
    started: list[ShardCluster | RankerCluster | CascadeCluster | GatewayCluster | GenerationCluster] = []
    generation: GenerationCluster | None = None
    try:
        shards = ShardCluster(world.plan_path, root / "shards", load_from=world.models, fault_hook=fault_hook, admin_token=admin_token)
        started.append(shards)
        shards.start(wait=False)  # bound, loading; the ranker waits for them by itself (torch's import overlaps)
        # Only the key variables, not a transport env: the launchers keep their defaults.
        keys = dict(env or {})
        rankers = RankerCluster(spec, world.models, shards.addresses, num_rankers=1, data_root=root / "rankers", admin_token=admin_token,
                                env=keys or None)  # fmt: skip
        started.append(rankers)
        rankers.start(wait=False)
        if generators:
            generation = GenerationCluster(spec, num_replicas=generators, data_root=root / "generation", env=keys)
            started.append(generation)
            generation.start(wait=False)
        for k in range(shards.num_shards):
            shards.wait_serving(k)
        rankers.wait_serving(0)
        cascade = CascadeCluster(spec, world.models, rankers.addresses, shards.addresses, data_root=root / "cascade", admin_token=admin_token,
                                 env=keys or None)  # fmt: skip
        started.append(cascade)
        cascade.start()
        for k in range(generators):
            assert generation is not None
            generation.wait_serving(k)
        gateway = GatewayCluster(spec, [cascade.address], rankers.addresses, data_root=root / "gateway", scrape=_stack_metrics(shards, rankers, cascade),
                                 env=env, extra_args=gateway_args, generators=generation.addresses if generation else ())  # fmt: skip
        started.append(gateway)
        gateway.start()
    except BaseException:
        for launcher in reversed(started):
            launcher.stop()
        raise
    return GatewayWorld(world, spec, shards, rankers, cascade, gateway, generation)


@contextlib.contextmanager
def gateway_world(root: Path, **kwargs: object) -> Iterator[GatewayWorld]:
    """:func:`start_gateway_world` as a context manager (stopped on exit)."""
    stack = start_gateway_world(root, **kwargs)  # type: ignore[arg-type]
    try:
        yield stack
    finally:
        stack.stop()
