"""``recserve deploy render``'s I/O: read the spec and plan, write the manifests as YAML.

One file per component (``00-config.yaml``, ``10-shard.yaml``, ...; ``kubectl apply -f
DIR`` applies them in name order, the ConfigMap first) plus ``cluster.toml``, the
rendered spec itself, for ``recserve serve --config`` and for review.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from recserve.config.spec import ClusterConfig
from recserve.deploy.manifests import DeployOptions, Rendered, render_manifests
from recserve.sharding.plan import ShardingPlan

__all__ = ["FILE_ORDER", "render_to_dir"]

# component label -> file: apply order (config, then what the callers need first).
FILE_ORDER = {"config": "00-config.yaml", "shard": "10-shard.yaml", "ranker": "20-ranker.yaml", "cascade": "30-cascade.yaml",
              "generation": "40-generation.yaml", "gateway": "50-gateway.yaml"}  # fmt: skip


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the spec, the plan) as literal blocks, readable in a diff."""


def _str(dumper: yaml.SafeDumper, text: str) -> Any:
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)


_Dumper.add_representer(str, _str)


def render_to_dir(cluster: ClusterConfig, plan_path: str | Path, out: str | Path, options: DeployOptions = DeployOptions()) -> tuple[Rendered, list[Path]]:
    """Render and write; returns the render and the files written (in apply order)."""
    plan_text = Path(plan_path).read_text()
    rendered = render_manifests(cluster, ShardingPlan.load(plan_path), plan_text, options)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    by_file: dict[str, list[dict[str, Any]]] = {}
    for obj in rendered.objects:
        by_file.setdefault(FILE_ORDER[obj["metadata"]["labels"]["app.kubernetes.io/component"]], []).append(obj)
    written = []
    for name in sorted(by_file):
        path = out_dir / name
        path.write_text(yaml.dump_all(by_file[name], Dumper=_Dumper, sort_keys=False, width=1 << 16))
        written.append(path)
    spec_path = out_dir / "cluster.toml"
    spec_path.write_text(rendered.spec_text)
    return rendered, [*written, spec_path]
