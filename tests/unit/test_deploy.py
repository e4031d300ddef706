"""``recserve deploy render``: the manifests of the default spec validate offline against
the Kubernetes schemas (kubernetes-validate, strict, the stated version), and keep the
invariants a cluster relies on: every shard pod has a volume, every gRPC container a gRPC
readiness probe, no secret value anywhere, the rendered spec naming the shards' DNS
names. Pure: no cluster, no sockets (the render is a function of spec + plan)."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from kubernetes_validate.utils import ValidationError, validate

from recserve.cli.main import main
from recserve.config import default_config, loads
from recserve.config.spec import ClusterConfig, RankerConfig, TableConfig, TenantConfig
from recserve.deploy import DeployOptions, dumps, render_manifests
from recserve.deploy.manifests import ADMIN_TOKEN_KEY, KUBERNETES_VERSION, PORTS, Rendered
from recserve.deploy.resources import DRAM_RSS_FACTOR, LIMIT_HEADROOM, SHARD_BASE_RSS_BYTES
from recserve.errors import ConfigError
from recserve.sharding import plan_tables
from recserve.sharding.estimates import estimate_plan
from recserve.sharding.plan import ShardingPlan

SECRET_VALUES = ("s3cr3t-admin-token-value", "feed-key-9f8e7d6c5b4a")


def _cluster(**overrides: Any) -> ClusterConfig:
    """The default spec plus a keyed tenant (its key must travel by Secret reference)."""
    base = default_config()
    tenants = (*base.tenants, TenantConfig(name="feed", api_key_env="FEED_API_KEY", rate_per_s=200.0, burst=50))
    return dataclasses.replace(base, tenants=tenants, **overrides)


def _render(cluster: ClusterConfig, tmp_path: Path, options: DeployOptions = DeployOptions()) -> Rendered:
    result = plan_tables(cluster.tables, None, cluster.sharding)
    path = tmp_path / "plan.json"
    result.plan.save(path)
    return render_manifests(cluster, ShardingPlan.load(path), path.read_text(), options)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    return _render(_cluster(), tmp_path_factory.mktemp("deploy"))


def _pod_specs(r: Rendered) -> dict[str, dict[str, Any]]:
    """Workload name -> its pod template spec."""
    return {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in r.objects if o["kind"] in ("StatefulSet", "Deployment")}


def test_spec_round_trips_through_toml() -> None:
    """The rendered spec is written from the validated object: loading it back gives the
    same config (infinite quotas, optional table overrides and tuples included)."""
    table = TableConfig(name="t", rows=10, dim=4, hot_fraction=0.5, column_splits=2)
    cluster = dataclasses.replace(_cluster(), tables=(*default_config().tables, table), shard_addresses=("a.b.svc:1", "c.d.svc:2"))
    text = dumps(cluster)
    assert loads(text) == cluster
    assert "max_concurrent_cost = inf" in text  # the key-less tenant's unbounded quota survives


def test_manifests_validate_against_kubernetes_schemas(rendered: Rendered) -> None:
    """Every object validates (strict: unknown fields are errors) for the stated
    Kubernetes version; the validator does reject a bad object (it is not a no-op)."""
    kinds = sorted({o["kind"] for o in rendered.objects})
    assert kinds == ["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Service", "StatefulSet"]
    for obj in rendered.objects:
        validate(obj, KUBERNETES_VERSION, strict=True)
    bad = copy.deepcopy(rendered.named("StatefulSet", "recserve-shard"))
    bad["spec"]["replica"] = 2  # a typo of `replicas`
    with pytest.raises(ValidationError):
        validate(bad, KUBERNETES_VERSION, strict=True)


def test_every_shard_pod_has_a_volume_and_a_stable_dns_name(rendered: Rendered) -> None:
    sts = rendered.named("StatefulSet", "recserve-shard")
    n = default_config().sharding.num_shards
    assert sts["spec"]["replicas"] == n
    claims = [c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]]
    assert claims == ["data"]
    pod = sts["spec"]["template"]["spec"]
    for container in pod["initContainers"] + pod["containers"]:  # the loader and the server write the same RocksDB
        assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]
    service = rendered.named("Service", sts["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    expected = tuple(f"recserve-shard-{k}.recserve-shard.recserve.svc.cluster.local:{PORTS['shard']}" for k in range(n))
    assert rendered.spec.shard_addresses == expected
    # The ConfigMap's spec is what the pods read: the same addresses, the rest the user's spec.
    shipped = loads(rendered.named("ConfigMap", "recserve-config")["data"]["cluster.toml"])
    assert shipped.shard_addresses == expected
    assert dataclasses.replace(shipped, shard_addresses=()) == _cluster()
    # Shard k is plan shard k: the ordinal from the pod-index label, one pod at a time on update.
    server = pod["containers"][0]
    assert server["args"][server["args"].index("--shard-id") + 1] == "$(SHARD_ID)"
    env = {e["name"]: e for e in server["env"]}
    assert env["SHARD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert sts["spec"]["updateStrategy"]["type"] in ("OnDelete", "RollingUpdate")
    pdb = rendered.named("PodDisruptionBudget", "recserve-shard")
    assert pdb["spec"]["maxUnavailable"] == 1


def test_every_grpc_container_has_grpc_probes_and_the_gateway_http_ones(rendered: Rendered) -> None:
    services = {"recserve-shard": "recserve.v1.EmbeddingShard", "recserve-ranker": "recserve.v1.Ranking",
                "recserve-cascade": "recserve.v1.Recommender", "recserve-generation": "recserve.v1.Generation"}  # fmt: skip
    pods = _pod_specs(rendered)
    grpc_containers = 0
    for name, pod in pods.items():
        for c in pod["containers"]:
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            if "grpc" not in ports:
                continue
            grpc_containers += 1
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                assert c[probe]["grpc"] == {"port": ports["grpc"], "service": services[name]}, (name, probe)
            assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 300  # tier loading, model loads
    assert grpc_containers == 4
    gateway = pods["recserve-gateway"]["containers"][0]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_no_secret_value_appears_and_secrets_are_referenced(rendered: Rendered, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the keys in the renderer's own environment, no value reaches any manifest; the
    admin token and each tenant key are secretKeyRefs to the named Secret."""
    monkeypatch.setenv("RECSERVE_ADMIN_TOKEN", SECRET_VALUES[0])
    monkeypatch.setenv("FEED_API_KEY", SECRET_VALUES[1])
    r = _render(_cluster(), tmp_path)
    text = yaml.safe_dump_all(list(r.objects)) + r.spec_text
    for value in SECRET_VALUES:
        assert value not in text
    assert not r.of_kind("Secret")
    pods = _pod_specs(r)
    gateway_env = {e["name"]: e for e in pods["recserve-gateway"]["containers"][0]["env"]}
    assert gateway_env["FEED_API_KEY"] == {"name": "FEED_API_KEY", "valueFrom": {"secretKeyRef": {"name": "recserve-secrets", "key": "FEED_API_KEY"}}}
    for name in ("recserve-shard", "recserve-ranker", "recserve-cascade"):
        env = {e["name"]: e for e in pods[name]["containers"][0]["env"]}
        assert env["RECSERVE_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "recserve-secrets", "key": ADMIN_TOKEN_KEY}
    for name in ("recserve-ranker", "recserve-cascade", "recserve-generation"):  # they authenticate tenants by x-api-key too
        env = {e["name"]: e for e in pods[name]["containers"][0]["env"]}
        assert env["FEED_API_KEY"] == gateway_env["FEED_API_KEY"]
    for pod in pods.values():  # no literal value for any secret-named variable
        for c in pod["containers"]:
            for e in c.get("env", []):
                if "TOKEN" in e["name"] or "KEY" in e["name"]:
                    assert "value" not in e, e


def test_shard_resources_follow_the_planners_estimate(tmp_path: Path) -> None:
    """Request = base + DRAM tiers x factor + row cache + block cache of the fullest shard
    (recomputed here from the plan's estimate); limit = request x headroom; CPU = threads."""
    server = dataclasses.replace(default_config().shard_server, row_cache_bytes=96 << 20, block_cache_bytes=32 << 20, threads=2)
    cluster = _cluster(shard_server=server)
    result = plan_tables(cluster.tables, None, cluster.sharding)
    r = _render(cluster, tmp_path)
    dram = estimate_plan(result.plan).bytes_per_shard["dram"]
    want = int(np.max(np.ceil(dram * DRAM_RSS_FACTOR))) + (96 << 20) + (32 << 20) + SHARD_BASE_RSS_BYTES
    res = r.named("StatefulSet", "recserve-shard")["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert res["requests"]["memory"] == f"{-(-want // (1 << 20))}Mi"
    assert res["limits"]["memory"] == f"{-(-math.ceil(want * LIMIT_HEADROOM) // (1 << 20))}Mi"
    assert res["requests"]["cpu"] == "2"


def test_cuda_rankers_request_a_gpu_and_tolerate_the_taint(tmp_path: Path) -> None:
    cpu = _pod_specs(_render(_cluster(ranker=RankerConfig(device="cpu")), tmp_path))["recserve-ranker"]
    assert "nvidia.com/gpu" not in cpu["containers"][0]["resources"]["limits"]
    assert "tolerations" not in cpu
    gpu = _pod_specs(_render(_cluster(ranker=RankerConfig(device="cuda")), tmp_path))["recserve-ranker"]
    assert gpu["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert gpu["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def test_autoscalers_budgets_and_scrape_targets_point_at_real_workloads(rendered: Rendered) -> None:
    deployments = {o["metadata"]["name"]: o for o in rendered.of_kind("Deployment")}
    hpas = {o["metadata"]["name"]: o for o in rendered.of_kind("HorizontalPodAutoscaler")}
    assert sorted(hpas) == ["recserve-gateway", "recserve-ranker"]
    for hpa in hpas.values():
        target = deployments[hpa["spec"]["scaleTargetRef"]["name"]]
        assert hpa["spec"]["minReplicas"] == target["spec"]["replicas"] <= hpa["spec"]["maxReplicas"]
    assert deployments["recserve-ranker"]["spec"]["replicas"] == default_config().topology.rankers
    workloads = {o["metadata"]["name"]: o for o in rendered.objects if o["kind"] in ("StatefulSet", "Deployment")}
    for pdb in rendered.of_kind("PodDisruptionBudget"):
        labels = workloads[pdb["metadata"]["name"]]["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert rendered.named("PodDisruptionBudget", "recserve-ranker")["spec"]["minAvailable"] >= 1
    # Replica sets are reached through headless Services the callers re-resolve.
    cascade = workloads["recserve-cascade"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert cascade[cascade.index("--rankers") + 1] == "recserve-ranker.recserve.svc.cluster.local:7200"
    assert rendered.named("Service", "recserve-ranker")["spec"]["clusterIP"] == "None"
    for name, w in workloads.items():
        ann = w["spec"]["template"]["metadata"]["annotations"]
        ports = {p["containerPort"] for c in w["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) in ports, name


def test_a_plan_for_another_shard_count_is_refused(tmp_path: Path) -> None:
    cluster = _cluster()
    other = plan_tables(cluster.tables, None, dataclasses.replace(cluster.sharding, num_shards=3))
    with pytest.raises(ConfigError, match="num_shards"):
        render_manifests(cluster, other.plan, "{}")
    with pytest.raises(ConfigError, match="deploy.namespace"):
        DeployOptions(namespace="Bad_NS")


def test_cli_writes_the_manifests_and_the_rendered_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = default_config()
    plan = tmp_path / "plan.json"
    plan_tables(cluster.tables, None, cluster.sharding).plan.save(plan)
    out = tmp_path / "k8s"
    assert main(["deploy", "render", "--plan", str(plan), "--out", str(out), "--namespace", "feed", "--image", "reg.example/recserve:1"]) == 0
    files = sorted(p.name for p in out.iterdir())
    assert files == ["00-config.yaml", "10-shard.yaml", "20-ranker.yaml", "30-cascade.yaml", "40-generation.yaml", "50-gateway.yaml", "cluster.toml"]
    docs = [d for f in sorted(out.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())]
    assert {d["metadata"]["namespace"] for d in docs} == {"feed"}
    images = {c["image"] for d in docs if d["kind"] in ("StatefulSet", "Deployment") for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == {"reg.example/recserve:1"}
    assert loads((out / "cluster.toml").read_text()).shard_addresses[0].startswith("recserve-shard-0.recserve-shard.feed.svc")
    assert "kubectl apply -f" in capsys.readouterr().out
