"""The local proof of ``recserve deploy render``: the rendered shard pods' own commands
(the init container's ``shard load``, then the server's ``shard serve``, with their
rendered args and env) run on this machine, with the rendered spec's DNS addresses
mapped to loopback by an override (:data:`recserve.routing.resolve.RESOLVE_ENV`'s
format); a lookup client built from the rendered ConfigMap (its spec's
``shard_addresses``, its plan) then returns exactly the source rows, as the shards the
default launcher starts do (``tests/integration/test_lookup_cluster.py``).

Only the pod-level substitutions Kubernetes itself makes are done here: ``$(SHARD_ID)``
from the pod-index label, the ConfigMap and the volumes mounted at their paths, and
free loopback ports instead of the pod's fixed ones (several pods share this host).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recserve.cluster.group import REPO_ROOT
from recserve.config import loads
from recserve.config.spec import ClusterConfig, FeatureConfig, ShardingConfig, ShardServerConfig, TableConfig
from recserve.deploy import DeployOptions, render_manifests
from recserve.deploy.manifests import CONFIG_DIR, DATA_DIR, MODELS_DIR, PORTS
from recserve.lookup.client import LookupClient
from recserve.lookup.config import LookupClientConfig
from recserve.routing.resolve import OverrideResolver, parse_overrides
from recserve.rpc.serving import wait_until_serving
from recserve.sharding import plan_tables
from recserve.sharding.plan import ShardingPlan

pytestmark = pytest.mark.integration

ADMIN_TOKEN = "local-proof-admin-token"
START_TIMEOUT_S = 120.0


def _spec() -> ClusterConfig:
    tables = (TableConfig(name="item", rows=4000, dim=32), TableConfig(name="category", rows=600, dim=16, pooling="mean"))
    features = (FeatureConfig(name="item_id", table="item"), FeatureConfig(name="category_id", table="category"))
    sharding = ShardingConfig(num_shards=2, hot_fraction=0.02, warm_fraction=0.10, hot_replicas=2, column_splits=2)
    server = ShardServerConfig(row_cache_bytes=1 << 20, block_cache_bytes=4 << 20, threads=1)
    return ClusterConfig(tables=tables, features=features, sharding=sharding, shard_server=server)


def _pod_args(args: list[str], *, k: int, root: Path, port: int) -> list[str]:
    """A container's rendered args as the kubelet and the volumes make them for pod k."""
    out = []
    for a in args:
        a = a.replace("$(SHARD_ID)", str(k)).replace(CONFIG_DIR, str(root / "config")).replace(MODELS_DIR, str(root / "models"))
        out.append(str(root / f"data-{k}") if a == DATA_DIR else a)
    for flag, value in (("--port", str(port)), ("--metrics-port", "0"), ("--host", "127.0.0.1")):
        if flag in out:
            out[out.index(flag) + 1] = value
    return out


def _env(container: dict, k: int) -> dict[str, str]:
    """The container's env: literal values as rendered, the pod-index label, the Secret's key."""
    env = {**os.environ}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e["valueFrom"]:
            env[e["name"]] = str(k)
        else:
            env[e["name"]] = ADMIN_TOKEN
    return env


@pytest.fixture(scope="module")
def pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ClusterConfig, ShardingPlan, dict[str, np.ndarray], str]]:
    """The rendered shard pods running locally; yields (rendered spec from the ConfigMap,
    its plan, the source rows, the override text mapping DNS names to loopback)."""
    root = tmp_path_factory.mktemp("deploy-local")
    spec = _spec()
    rng = np.random.default_rng(0)
    freq = {"item": 1.0 / np.arange(1, 4001) ** 1.05}
    result = plan_tables(spec.tables, freq, spec.sharding)
    result.plan.save(root / "plan.json")
    rendered = render_manifests(spec, result.plan, (root / "plan.json").read_text(), DeployOptions(namespace="feed"))
    config = rendered.named("ConfigMap", "recserve-config")["data"]
    (root / "config").mkdir()
    for name, text in config.items():
        (root / "config" / name).write_text(text)
    (root / "models").mkdir()
    sources = {t.name: rng.standard_normal((t.rows, t.dim)).astype(np.float32) for t in spec.tables}
    for name, array in sources.items():
        np.save(root / "models" / f"{name}.npy", array)
    pod = rendered.named("StatefulSet", "recserve-shard")["spec"]["template"]["spec"]
    (load,), (serve,) = pod["initContainers"], pod["containers"]
    procs: list[subprocess.Popen[bytes]] = []
    overrides = []
    try:
        for k in range(spec.sharding.num_shards):
            subprocess.run([sys.executable, "-m", "recserve", *_pod_args(load["args"], k=k, root=root, port=0)], cwd=REPO_ROOT,
                           env=_env(load, k), check=True, capture_output=True, timeout=START_TIMEOUT_S)  # fmt: skip
            port_file = root / f"port-{k}"
            argv = [sys.executable, "-m", "recserve", *_pod_args(serve["args"], k=k, root=root, port=0), "--port-file", str(port_file)]
            log = open(root / f"shard-{k}.log", "wb")
            procs.append(subprocess.Popen(argv, cwd=REPO_ROOT, env=_env(serve, k), stdout=log, stderr=subprocess.STDOUT))
            log.close()
            end = time.monotonic() + START_TIMEOUT_S
            while not (port_file.is_file() and port_file.read_text().strip()):
                assert procs[-1].poll() is None, (root / f"shard-{k}.log").read_text()[-2000:]
                assert time.monotonic() < end, "shard did not bind"
                time.sleep(0.05)
            overrides.append(f"{rendered.spec.shard_addresses[k]}=127.0.0.1:{int(port_file.read_text())}")
        shipped = loads((root / "config" / "cluster.toml").read_text())
        yield shipped, ShardingPlan.load(root / "config" / "plan.json"), sources, ",".join(overrides)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_rendered_shard_pods_serve_the_source_rows_at_the_rendered_addresses(pods: tuple[ClusterConfig, ShardingPlan, dict[str, np.ndarray], str]) -> None:
    shipped, plan, sources, override_text = pods
    assert shipped.shard_addresses[0] == f"recserve-shard-0.recserve-shard.feed.svc.cluster.local:{PORTS['shard']}"
    resolver = OverrideResolver(parse_overrides(override_text))
    addresses = [resolver.map(a) for a in shipped.shard_addresses]
    assert all(a.startswith("127.0.0.1:") for a in addresses)
    rng = np.random.default_rng(1)
    item_ids = rng.integers(0, 4000, size=300)  # hot, warm (column-split) and cold ids alike
    category_ids = rng.integers(0, 600, size=50)

    async def go() -> tuple[torch.Tensor, torch.Tensor, int]:
        await wait_until_serving(addresses, what="shard", timeout_s=START_TIMEOUT_S)
        client = LookupClient.connect(LookupClientConfig.from_cluster(shipped), plan, addresses)
        await client.start()
        try:
            kjt = KeyedJaggedTensor(keys=["item_id", "category_id"], values=torch.from_numpy(np.concatenate([item_ids, category_ids])),
                                    lengths=torch.tensor([len(item_ids), len(category_ids)]))  # fmt: skip
            result = await client.lookup(kjt, pooled=False, timeout_s=30)
        finally:
            await client.aclose()
        return result.rows["item_id"], result.rows["category_id"], result.missing

    items, categories, missing = asyncio.run(go())
    assert missing == 0
    np.testing.assert_array_equal(items.numpy(), sources["item"][item_ids])
    np.testing.assert_array_equal(categories.numpy(), sources["category"][category_ids])
    assert dataclasses.replace(shipped, shard_addresses=()) == _spec()
