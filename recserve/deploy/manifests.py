"""Kubernetes objects for one recserve cluster, from its spec and sharding plan.

:func:`render_manifests` is a pure function of (spec, plan text, options): no I/O, so a
unit test checks every object. What it renders (docs/architecture.md §3, "On Kubernetes"):

* **ConfigMap** ``<name>-config``: ``cluster.toml`` (the spec as validated, with
  ``shard_addresses`` = the shards' stable DNS names) and ``plan.json`` (the plan as
  given). Every container mounts it at ``/etc/recserve``.
* **Shards**: a headless Service ``<name>-shard`` and a StatefulSet of ``num_shards``
  pods, ``<name>-shard-K`` = plan shard K (its ordinal, read from the
  ``apps.kubernetes.io/pod-index`` label, Kubernetes >= 1.28), each with a
  PersistentVolumeClaim for RocksDB. Pod K is reached at
  ``<name>-shard-K.<name>-shard.<ns>.svc.<domain>:7100``, the rendered ``shard_addresses``.
  An init container bulk-loads the export into the shard's RocksDB (idempotent: a
  restart skips it), so the server's memory limit is not charged with the load's peak.
  Rollout: ``RollingUpdate`` one pod at a time, each waiting for its predecessor to be
  Ready; ``partition`` holds back pods below it (``kubectl patch``, README).
* **Rankers, cascade, generation replicas**: Deployments behind headless Services
  (replicas from ``[topology]``). The callers are given the one headless name;
  :mod:`recserve.routing.resolve` re-resolves it, so pods the HPA adds get traffic and
  removed ones stop getting it. Rankers whose ``[ranker] device`` is ``cuda`` request
  ``nvidia.com/gpu`` and tolerate the GPU taint.
* **Gateway**: a Deployment and a ClusterIP Service (the entry point), HTTP probes.
* **HorizontalPodAutoscalers** (CPU) for the rankers and the gateway;
  **PodDisruptionBudgets**: one shard unavailable at a time, rankers kept at
  ``max(1, rankers - 1)``, the gateway (2 replicas) at 1.
* **Probes**: gRPC (``grpc:`` with the service name) for the gRPC servers, HTTP
  ``/readyz`` / ``/healthz`` for the gateway; start-up probes sized to tier loading.
* **Secrets** are referenced by name (``secretKeyRef``), never rendered: the admin token
  (key ``admin-token``, into ``[admin] token_env``) and one key per tenant ``api_key_env``
  (into the gateway and the gRPC servers that authenticate tenants).
* **Observability**: ``prometheus.io/scrape`` / ``port`` / ``path`` on every pod
  template with a metrics port.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from recserve.config.spec import ClusterConfig
from recserve.deploy.resources import ShardMemory, mebibytes, shard_memory
from recserve.deploy.spec_toml import dumps
from recserve.errors import ConfigError, require
from recserve.lookup.transport import transport_env
from recserve.sharding.plan import ShardingPlan

__all__ = ["ADMIN_TOKEN_KEY", "KUBERNETES_VERSION", "PORTS", "DeployOptions", "Rendered", "render_manifests"]

KUBERNETES_VERSION = "1.30.0"  # what the manifests are validated against (kubernetes-validate)
ADMIN_TOKEN_KEY = "admin-token"  # its key in the Secret
CONFIG_DIR = "/etc/recserve"
MODELS_DIR = "/models"
DATA_DIR = "/data"
PORTS = {"shard": 7100, "ranker": 7200, "cascade": 7300, "generation": 7400, "gateway": 8080, "metrics": 9090}
HEALTH_SERVICE = {"shard": "recserve.v1.EmbeddingShard", "ranker": "recserve.v1.Ranking", "cascade": "recserve.v1.Recommender", "generation": "recserve.v1.Generation"}
RUN_AS_USER = 10001  # the image's non-root user (Dockerfile)
PROBE_PERIOD_S = 10
GPU_RESOURCE = "nvidia.com/gpu"
TIER_LOAD_BYTES_PER_S = 50 << 20  # a cold start reads every DRAM tier row from RocksDB; slow disks ~50 MB/s
GATEWAY_REPLICAS = 2  # two, so that its PDB (minAvailable 1) still lets a node drain
MIN_STARTUP_S = 300  # torch + torchrec imports and the model load alone take a minute on a small node


@dataclasses.dataclass(frozen=True)
class DeployOptions:
    """How to render (``recserve deploy render`` flags).

    * ``namespace`` / ``name``: where, and the prefix of every object (``recserve-shard``).
    * ``image``: the container image (``Dockerfile``; its entrypoint is ``recserve``).
    * ``models_claim``: an existing PersistentVolumeClaim (ReadOnlyMany) holding the
      ``recserve train --out`` export, mounted at ``/models``.
    * ``secret_name``: the Secret holding ``admin-token`` and the tenants' keys.
    * ``storage_class``: of the shards' volumes ('' = the cluster's default).
    * ``cluster_domain``: the DNS suffix of Services (``cluster.local``).
    * ``ranker_max_replicas`` / ``gateway_max_replicas``: HPA ceilings (0 = 4x the floor).
    * ``ranker_memory_bytes`` / ``gateway_memory_bytes``: those pods' memory request
      (the planner sizes shards only; a ranker holds its dense models and torch).
    * ``initial_load``: the shards' init container bulk-loads the export (False: the
      volumes already hold the rows, e.g. written by ``recserve shard migrate`` after a
      re-plan, which a load of the export would overwrite).
    """

    namespace: str = "recserve"
    name: str = "recserve"
    image: str = "recserve:latest"
    models_claim: str = "recserve-models"
    secret_name: str = "recserve-secrets"
    storage_class: str = ""
    cluster_domain: str = "cluster.local"
    ranker_max_replicas: int = 0
    gateway_max_replicas: int = 0
    ranker_memory_bytes: int = 2 << 30
    gateway_memory_bytes: int = 512 << 20
    initial_load: bool = True

    def __post_init__(self) -> None:
        for key in ("namespace", "name", "models_claim", "secret_name"):
            v = getattr(self, key)
            require(_dns_label(v), f"deploy.{key}", v, "use a DNS label: lower-case letters, digits and '-', at most 63 characters, starting and ending alphanumeric")
        require(bool(self.image) and not any(c.isspace() for c in self.image), "deploy.image", self.image, "give an image reference, e.g. registry.example.com/recserve:1.0")
        require(self.storage_class == "" or _dns_label(self.storage_class.replace(".", "-")), "deploy.storage_class", self.storage_class, "name a StorageClass, or '' for the default")
        for key in ("ranker_max_replicas", "gateway_max_replicas"):
            require(getattr(self, key) >= 0, f"deploy.{key}", getattr(self, key), "use 0 (4x the minimum) or a replica count")
        for key in ("ranker_memory_bytes", "gateway_memory_bytes"):
            require(getattr(self, key) >= 64 << 20, f"deploy.{key}", getattr(self, key), "use at least 64 MiB")


def _dns_label(text: str) -> bool:
    return 0 < len(text) <= 63 and text.isascii() and text.replace("-", "").isalnum() and text == text.lower() and text[0].isalnum() and text[-1].isalnum()


@dataclasses.dataclass(frozen=True)
class Rendered:
    """The objects (plain dicts, in apply order) and what they were derived from."""

    objects: tuple[dict[str, Any], ...]
    spec: ClusterConfig  # the rendered spec (shard_addresses = DNS names)
    spec_text: str  # its TOML, as in the ConfigMap
    memory: ShardMemory

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def named(self, kind: str, name: str) -> dict[str, Any]:
        for o in self.objects:
            if o["kind"] == kind and o["metadata"]["name"] == name:
                return o
        raise ConfigError(f"no {kind} named {name!r} was rendered; rendered: {[(o['kind'], o['metadata']['name']) for o in self.objects]}")


def shard_dns_names(cluster: ClusterConfig, options: DeployOptions) -> tuple[str, ...]:
    """The stable ``HOST:PORT`` of every shard pod (StatefulSet pod + headless Service)."""
    svc = f"{options.name}-shard"
    return tuple(f"{svc}-{k}.{svc}.{options.namespace}.svc.{options.cluster_domain}:{PORTS['shard']}" for k in range(cluster.sharding.num_shards))


def service_address(kind: str, options: DeployOptions) -> str:
    """The headless Service name of a replica set (``HOST:PORT``), re-resolved by its callers."""
    return f"{options.name}-{kind}.{options.namespace}.svc.{options.cluster_domain}:{PORTS[kind]}"


def render_manifests(cluster: ClusterConfig, plan: ShardingPlan, plan_text: str, options: DeployOptions = DeployOptions()) -> Rendered:
    """Every object of the cluster (module docstring). ``plan_text`` is the plan file's
    content (shipped as is); ``plan`` its parsed form, which must match the spec."""
    require(plan.num_shards == cluster.sharding.num_shards, "--plan num_shards", plan.num_shards,
            f"use a plan of sharding.num_shards = {cluster.sharding.num_shards} shards (recserve shard plan --config SPEC)")  # fmt: skip
    # Kubernetes' gRPC probes speak plaintext only: a TLS-only server would never turn Ready.
    require(not cluster.tls.enabled, "tls.cert_file", cluster.tls.cert_file,
            "leave [tls] out of a spec rendered for Kubernetes (its gRPC probes are plaintext): terminate TLS in the cluster's service mesh")  # fmt: skip
    missing = sorted({t.name for t in cluster.tables} - set(plan.tables))
    require(not missing, "--plan tables", sorted(plan.tables), f"plan every table of the spec (missing: {missing})")
    spec = dataclasses.replace(cluster, shard_addresses=shard_dns_names(cluster, options))
    spec_text = dumps(spec)
    memory = shard_memory(plan, cluster.shard_server)
    b = _Builder(spec, options, memory)
    objects: list[dict[str, Any]] = [b.config_map(spec_text, plan_text)]
    objects += b.shards()
    objects += b.replica_set("ranker", cluster.topology.rankers)
    objects.append(b.hpa("ranker", cluster.topology.rankers, options.ranker_max_replicas))
    objects.append(b.pdb("ranker", {"minAvailable": max(1, cluster.topology.rankers - 1)}))
    objects += b.replica_set("cascade", 1)
    if cluster.topology.generators:
        objects += b.replica_set("generation", cluster.topology.generators)
    objects += b.gateway()
    return Rendered(objects=tuple(objects), spec=spec, spec_text=spec_text, memory=memory)


class _Builder:
    """The objects of one render; one method per object family."""

    def __init__(self, spec: ClusterConfig, options: DeployOptions, memory: ShardMemory) -> None:
        self.spec = spec
        self.o = options
        self.memory = memory

    # ---- shared pieces ------------------------------------------------------------

    def meta(self, name: str, component: str, **extra: Any) -> dict[str, Any]:
        return {"name": name, "namespace": self.o.namespace, "labels": self.labels(component), **extra}

    def labels(self, component: str) -> dict[str, str]:
        return {"app.kubernetes.io/name": "recserve", "app.kubernetes.io/instance": self.o.name, "app.kubernetes.io/component": component}

    def selector(self, component: str) -> dict[str, str]:
        return {"app.kubernetes.io/instance": self.o.name, "app.kubernetes.io/component": component}

    def config_map(self, spec_text: str, plan_text: str) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": self.meta(f"{self.o.name}-config", "config"),
                "data": {"cluster.toml": spec_text, "plan.json": plan_text}}  # fmt: skip

    def secret_env(self, env: str, key: str) -> dict[str, Any]:
        """An env var from the Secret, by reference: the value is never in a manifest."""
        return {"name": env, "valueFrom": {"secretKeyRef": {"name": self.o.secret_name, "key": key}}}

    def tenant_env(self) -> list[dict[str, Any]]:
        """Every keyed tenant's API key, from the Secret: the gateway and the gRPC servers
        that authenticate tenants by ``x-api-key`` (Ranking, Recommender, Generation)."""
        return [self.secret_env(t.api_key_env, t.api_key_env) for t in self.spec.tenants if t.api_key_env]

    def grpc_env(self) -> list[dict[str, Any]]:
        """The lookup path's process-start settings (gRPC I/O path, malloc thresholds)."""
        return [{"name": k, "value": v} for k, v in sorted(transport_env(self.spec.lookup).items())]

    def volumes(self) -> list[dict[str, Any]]:
        return [
            {"name": "config", "configMap": {"name": f"{self.o.name}-config"}},
            {"name": "models", "persistentVolumeClaim": {"claimName": self.o.models_claim, "readOnly": True}},
        ]

    def mounts(self) -> list[dict[str, Any]]:
        return [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}, {"name": "models", "mountPath": MODELS_DIR, "readOnly": True}]

    def grpc_probes(self, kind: str, startup_s: int) -> dict[str, Any]:
        """Readiness and liveness from the process's own gRPC health (its service name:
        NOT_SERVING until loaded, and while draining); the start-up probe holds liveness
        off for ``startup_s`` while the process loads."""
        check = {"grpc": {"port": PORTS[kind], "service": HEALTH_SERVICE[kind]}}
        return {
            "startupProbe": {**check, "periodSeconds": PROBE_PERIOD_S, "failureThreshold": max(1, math.ceil(startup_s / PROBE_PERIOD_S))},
            "readinessProbe": {**check, "periodSeconds": 5, "failureThreshold": 2},
            "livenessProbe": {**check, "periodSeconds": PROBE_PERIOD_S, "failureThreshold": 6},
        }

    def scrape(self, port: int) -> dict[str, str]:
        return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}

    def security(self) -> dict[str, Any]:
        return {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER, "fsGroup": RUN_AS_USER}

    def container_security(self) -> dict[str, Any]:
        return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": False, "capabilities": {"drop": ["ALL"]}}

    def headless(self, kind: str, *, publish_not_ready: bool = False) -> dict[str, Any]:
        ports = [{"name": "grpc", "port": PORTS[kind], "targetPort": PORTS[kind]}, {"name": "metrics", "port": PORTS["metrics"], "targetPort": PORTS["metrics"]}]
        spec: dict[str, Any] = {"clusterIP": "None", "selector": self.selector(kind), "ports": ports}
        if publish_not_ready:
            spec["publishNotReadyAddresses"] = True
        return {"apiVersion": "v1", "kind": "Service", "metadata": self.meta(f"{self.o.name}-{kind}", kind), "spec": spec}

    def pdb(self, kind: str, budget: dict[str, int]) -> dict[str, Any]:
        return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": self.meta(f"{self.o.name}-{kind}", kind),
                "spec": {**budget, "selector": {"matchLabels": self.selector(kind)}}}  # fmt: skip

    def hpa(self, kind: str, floor: int, ceiling: int) -> dict[str, Any]:
        return {
            "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": self.meta(f"{self.o.name}-{kind}", kind),
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{self.o.name}-{kind}"},
                "minReplicas": floor, "maxReplicas": ceiling or 4 * floor,
                "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}}}],
            },
        }  # fmt: skip

    # ---- shards -------------------------------------------------------------------

    def shards(self) -> list[dict[str, Any]]:
        kind, name, spec = "shard", f"{self.o.name}-shard", self.spec
        server = spec.shard_server
        threads = server.threads
        mem = self.memory
        resources = {"requests": {"cpu": str(threads), "memory": mebibytes(mem.request_bytes)}, "limits": {"memory": mebibytes(mem.limit_bytes)}}
        ordinal = {"name": "SHARD_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}}
        common = ["--plan", f"{CONFIG_DIR}/plan.json", "--shard-id", "$(SHARD_ID)", "--data", DATA_DIR]
        # Start-up: the tiers are read back from RocksDB on every start.
        startup_s = max(MIN_STARTUP_S, int(mem.dram_bytes.max() // TIER_LOAD_BYTES_PER_S) * 2)
        load = {
            "name": "load", "image": self.o.image, "args": ["shard", "load", *common, "--from", MODELS_DIR],
            "env": [ordinal], "volumeMounts": [*self.mounts(), {"name": "data", "mountPath": DATA_DIR}],
            "resources": {"requests": resources["requests"], "limits": {"memory": mebibytes(2 * mem.limit_bytes)}},
            "securityContext": self.container_security(),
        }  # fmt: skip
        serve = {
            "name": "shard", "image": self.o.image,
            "args": ["shard", "serve", *common, "--host", "0.0.0.0", "--port", str(PORTS["shard"]), "--metrics-port", str(PORTS["metrics"]),
                     "--row-cache-bytes", str(server.row_cache_bytes), "--block-cache-bytes", str(server.block_cache_bytes),
                     "--threads", str(threads), "--max-ids-per-rpc", str(server.max_ids_per_rpc),
                     "--max-message-bytes", str(server.max_message_bytes), "--max-bags-per-rpc", str(server.max_bags_per_rpc)],
            "ports": [{"name": "grpc", "containerPort": PORTS["shard"]}, {"name": "metrics", "containerPort": PORTS["metrics"]}],
            "env": [ordinal, self.secret_env(self.spec.admin.token_env, ADMIN_TOKEN_KEY), *self.grpc_env()],
            "volumeMounts": [*self.mounts(), {"name": "data", "mountPath": DATA_DIR}],
            "resources": resources, "securityContext": self.container_security(), **self.grpc_probes(kind, startup_s),
        }  # fmt: skip
        claim: dict[str, Any] = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": mebibytes(mem.volume_bytes)}}}
        if self.o.storage_class:
            claim["storageClassName"] = self.o.storage_class
        statefulset = {
            "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": self.meta(name, kind),
            "spec": {
                "serviceName": name, "replicas": spec.sharding.num_shards,
                # Shards are independent: start (and load) them all at once; updates still
                # go one pod at a time, each after its predecessor is Ready.
                "podManagementPolicy": "Parallel",
                "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}},
                "selector": {"matchLabels": self.selector(kind)},
                "template": {
                    "metadata": {"labels": self.labels(kind), "annotations": self.scrape(PORTS["metrics"])},
                    "spec": {"securityContext": self.security(), "terminationGracePeriodSeconds": 30,
                             "initContainers": [load] if self.o.initial_load else [], "containers": [serve], "volumes": self.volumes()},
                },
                "volumeClaimTemplates": [{"metadata": {"name": "data", "labels": self.labels(kind)}, "spec": claim}],
                "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Retain", "whenScaled": "Retain"},
            },
        }  # fmt: skip
        # DNS names exist while a shard loads: rankers wait for SERVING by gRPC health themselves.
        return [self.headless(kind, publish_not_ready=True), statefulset, self.pdb(kind, {"maxUnavailable": 1})]

    # ---- rankers, cascade, generation ----------------------------------------------

    def replica_set(self, kind: str, replicas: int) -> list[dict[str, Any]]:
        spec, o = self.spec, self.o
        common = ["--config", f"{CONFIG_DIR}/cluster.toml", "--host", "0.0.0.0", "--port", str(PORTS[kind]), "--metrics-port", str(PORTS["metrics"])]
        env = [*self.grpc_env(), *self.tenant_env()]
        resources: dict[str, Any] = {"requests": {"memory": mebibytes(o.ranker_memory_bytes)}, "limits": {"memory": mebibytes(o.ranker_memory_bytes * 2)}}
        extra: dict[str, Any] = {}
        if kind == "ranker":
            args = ["ranker", "serve", "--models", MODELS_DIR, *common]
            env.append(self.secret_env(self.spec.admin.token_env, ADMIN_TOKEN_KEY))
            threads = spec.ranker.threads or 1
            resources["requests"]["cpu"] = str(threads)
            if spec.ranker.device == "cuda":
                resources["limits"][GPU_RESOURCE] = 1
                extra["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
        elif kind == "cascade":
            args = ["cascade", "serve", "--models", MODELS_DIR, *common, "--rankers", service_address("ranker", o)]
            env.append(self.secret_env(self.spec.admin.token_env, ADMIN_TOKEN_KEY))
            resources["requests"]["cpu"] = "1"
        else:
            args = ["generate", "serve", *common]
            resources["requests"]["cpu"] = str(spec.generation.threads or 1)
            if spec.generation.device == "cuda":
                resources["limits"][GPU_RESOURCE] = 1
                extra["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
        container = {
            "name": kind, "image": o.image, "args": args,
            "ports": [{"name": "grpc", "containerPort": PORTS[kind]}, {"name": "metrics", "containerPort": PORTS["metrics"]}],
            "env": env, "volumeMounts": self.mounts(), "resources": resources, "securityContext": self.container_security(),
            **self.grpc_probes(kind, MIN_STARTUP_S),
        }  # fmt: skip
        deployment = {
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": self.meta(f"{o.name}-{kind}", kind),
            "spec": {
                "replicas": replicas, "selector": {"matchLabels": self.selector(kind)},
                # A new pod serves before an old one stops: capacity never dips in a rollout.
                "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                "template": {
                    "metadata": {"labels": self.labels(kind), "annotations": self.scrape(PORTS["metrics"])},
                    "spec": {"securityContext": self.security(), "terminationGracePeriodSeconds": 30, "containers": [container],
                             "volumes": self.volumes(), **extra},
                },
            },
        }  # fmt: skip
        return [self.headless(kind), deployment]

    # ---- gateway ------------------------------------------------------------------

    def gateway(self) -> list[dict[str, Any]]:
        kind, spec, o = "gateway", self.spec, self.o
        port = PORTS["gateway"]
        args = ["gateway", "serve", "--config", f"{CONFIG_DIR}/cluster.toml", "--host", "0.0.0.0", "--port", str(port),
                "--recommenders", service_address("cascade", o), "--rankers", service_address("ranker", o)]  # fmt: skip
        if spec.topology.generators:
            args += ["--generators", service_address("generation", o)]
        env = self.tenant_env()
        http = {"port": port}
        container = {
            "name": kind, "image": o.image, "args": args, "ports": [{"name": "http", "containerPort": port}], "env": env,
            "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}],
            "resources": {"requests": {"cpu": "1", "memory": mebibytes(o.gateway_memory_bytes)}, "limits": {"memory": mebibytes(o.gateway_memory_bytes * 2)}},
            "securityContext": self.container_security(),
            "startupProbe": {"httpGet": {"path": "/healthz", **http}, "periodSeconds": 5, "failureThreshold": 24},
            "readinessProbe": {"httpGet": {"path": "/readyz", **http}, "periodSeconds": 5, "failureThreshold": 2},
            "livenessProbe": {"httpGet": {"path": "/healthz", **http}, "periodSeconds": PROBE_PERIOD_S, "failureThreshold": 6},
        }  # fmt: skip
        deployment = {
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": self.meta(f"{o.name}-{kind}", kind),
            "spec": {
                "replicas": GATEWAY_REPLICAS, "selector": {"matchLabels": self.selector(kind)},
                "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                "template": {
                    "metadata": {"labels": self.labels(kind), "annotations": self.scrape(port)},  # /metrics on the API port
                    "spec": {"securityContext": self.security(), "terminationGracePeriodSeconds": 30, "containers": [container],
                             "volumes": [{"name": "config", "configMap": {"name": f"{o.name}-config"}}]},
                },
            },
        }  # fmt: skip
        service = {"apiVersion": "v1", "kind": "Service", "metadata": self.meta(f"{o.name}-{kind}", kind),
                   "spec": {"selector": self.selector(kind), "ports": [{"name": "http", "port": 80, "targetPort": port}]}}  # fmt: skip
        return [service, deployment, self.hpa(kind, GATEWAY_REPLICAS, o.gateway_max_replicas), self.pdb(kind, {"minAvailable": GATEWAY_REPLICAS - 1})]
