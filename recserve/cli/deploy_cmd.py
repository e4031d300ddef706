"""``recserve deploy``: run recserve on Kubernetes.

``recserve deploy render --config SPEC --plan PLAN --out DIR [--namespace NS] [--image IMAGE]``
writes plain YAML manifests (StatefulSet of shards with a volume each, Deployments of
rankers / cascade / generation replicas / gateway, headless Services, HPAs, PDBs, a
ConfigMap with the spec and the plan) to DIR, then ``kubectl apply -f DIR``
(README, "Deploying on Kubernetes"; :mod:`recserve.deploy`). PLAN is a ``recserve shard
plan --config SPEC --out PLAN`` file; secrets are referenced by name, never written.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("deploy", help="Kubernetes: render manifests from the cluster spec and its sharding plan")
    sub = parser.add_subparsers(dest="deploy_command", metavar="SUBCOMMAND")
    render = sub.add_parser("render", help="write the Kubernetes manifests of a spec and plan to a directory")
    render.add_argument("--config", type=Path, default=None, help="cluster spec TOML (default: the embedded spec)")
    render.add_argument("--plan", type=Path, required=True, help="the sharding plan JSON (recserve shard plan --out)")
    render.add_argument("--out", type=Path, required=True, help="directory for the YAML files (created)")
    render.add_argument("--namespace", default="recserve", help="Kubernetes namespace (default recserve)")
    render.add_argument("--image", default="recserve:latest", help="container image (built from the Dockerfile; default recserve:latest)")
    render.add_argument("--name", default="recserve", help="prefix of every object's name (default recserve)")
    render.add_argument("--models-claim", default="recserve-models", help="PersistentVolumeClaim holding the `recserve train --out` export (default recserve-models)")
    render.add_argument("--secret", default="recserve-secrets", help="Secret with the admin-token key and one key per tenant api_key_env (default recserve-secrets)")
    render.add_argument("--storage-class", default="", help="StorageClass of the shards' volumes (default: the cluster's)")
    render.add_argument("--no-initial-load", action="store_true",
                        help="no bulk-load init container: the shards' volumes already hold the rows (after `recserve shard migrate`)")
    render.set_defaults(func=_render)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def _render(args: argparse.Namespace) -> int:
    from recserve.config import load
    from recserve.deploy.manifests import KUBERNETES_VERSION, DeployOptions
    from recserve.deploy.render import render_to_dir
    from recserve.errors import ConfigError

    if not args.plan.is_file():
        raise ConfigError(f"--plan = {str(args.plan)!r} is invalid: no such file; write one with `recserve shard plan --config SPEC --out PLAN`")
    options = DeployOptions(namespace=args.namespace, name=args.name, image=args.image, models_claim=args.models_claim,
                            secret_name=args.secret, storage_class=args.storage_class, initial_load=not args.no_initial_load)  # fmt: skip
    rendered, files = render_to_dir(load(args.config), args.plan, args.out, options)
    mem = rendered.memory
    print(f"recserve deploy: {len(rendered.objects)} objects for Kubernetes >= 1.28 (validated against {KUBERNETES_VERSION}) in namespace {args.namespace}:")
    for path in files:
        print(f"  {path}")
    print(f"  shard pods: memory request {mem.request_bytes:,} B, limit {mem.limit_bytes:,} B, volume {mem.volume_bytes:,} B each")
    print(f"next: kubectl create namespace {args.namespace}; kubectl -n {args.namespace} create secret generic {args.secret} --from-literal=admin-token=...;"
          f" kubectl apply -f {args.out}")  # fmt: skip
    return 0
