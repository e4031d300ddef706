"""``recserve bench faults --json`` as a user runs it, CI-sized: the tiny trained world
(tests/integration/ranker_world.py) served by a supervised cluster of 3 shards, 2
rankers, the cascade and the gateway, two faults of 1.5 s phases at a given knee. It
checks the report's keys and the invariants that do not depend on timing: no
acknowledged upsert is lost across a SIGKILL of its shards, a "full disk" (RocksDB writes
raising an I/O error) refuses every upsert loudly while its rows stay readable and
unchanged, every request sent is accounted for, and no secret (the run's admin token
and tenant key) reaches any log."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from recserve.bench.faults_report import FIGURE_KEYS
from recserve.cluster.group import REPO_ROOT
from tests.integration.gateway_world import world_spec
from tests.integration.ranker_world import make_ranker_world

pytestmark = pytest.mark.integration


def test_bench_faults_json_keys_and_invariants(tmp_path: Path) -> None:
    world = make_ranker_world(tmp_path / "world")
    text = world_spec(world, "[topology]\nrankers = 2\n")
    assert "num_shards = 2" in text
    spec = tmp_path / "faults.toml"
    spec.write_text(text.replace("num_shards = 2", "num_shards = 3", 1))
    argv = [sys.executable, "-m", "recserve", "bench", "faults", "--models", str(world.models), "--catalog", str(world.root / "catalog"),
            "--config", str(spec), "--faults", "upserts,disk_full", "--before", "1.5", "--during", "1.5", "--after", "1.5",
            "--knee-rps", "10", "--upserts", "100", "--out", str(tmp_path / "out"), "--json"]  # fmt: skip
    out = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert list(report["faults"]) == ["upserts", "disk_full"]
    for name, figures in [*report["faults"].items(), ("total", report["total"])]:
        assert tuple(figures) == FIGURE_KEYS, name
    meta = report["meta"]
    assert report["total"]["lost_upserts"] == 0 and report["faults"]["upserts"]["lost_upserts"] == 0
    assert meta["upserts"]["rows_acknowledged"] == meta["upserts"]["rows_read_back"] == 100
    disk = meta["disk_full"]
    assert disk["upserts_refused"] == disk["upserts_tried"] > 0 and disk["reads_found"] == disk["reads_tried"] > 0
    assert disk["rows_unchanged"] == disk["reads_tried"]  # a failed write changed nothing (not the DRAM tiers either)
    for name, figures in report["faults"].items():  # every request sent has exactly one recorded outcome
        sent = meta["generator"][name]
        assert figures["requests"] == sent["requests"] == sent["sent"] > 0, name
        assert figures["failed"] + figures["shed"] <= figures["requests"]
    assert Path(meta["timeline_png"]).stat().st_size > 0
    # The load authenticated with a tenant key and the upserts with the admin token;
    # neither reached any log of the run (the gateway issue's no-secrets check).
    assert meta["no_secrets"]["logs_scanned"] >= 7 and meta["no_secrets"]["found"] == []
    assert "UNAUTHENTICATED" not in disk["refused_with"] and "PERMISSION_DENIED" not in disk["refused_with"]  # refused for the disk, not the token
