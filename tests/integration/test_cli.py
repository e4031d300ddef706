"""The ``recserve`` command as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from recserve.config import default_config

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_help_lists_subcommands_without_importing_torch() -> None:
    out = _run("-m", "recserve", "--help")
    assert out.returncode == 0, out.stderr
    for cmd in ("catalog", "shard", "bench", "demo", "serve", "train", "loadtest"):
        assert f"    {cmd}" in out.stdout, cmd
    probe = _run("-c", "import sys; from recserve.cli.main import build_parser; build_parser(); print(sorted(m for m in ('torch', 'torchrec') if m in sys.modules))")
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "[]"


def test_bad_config_path_is_a_clear_error(tmp_path: Path) -> None:
    out = _run("-m", "recserve", "demo", "--config", str(tmp_path / "missing.toml"))
    assert out.returncode == 2
    assert "missing.toml" in out.stderr and "no such file" in out.stderr


def test_shard_plan_writes_a_loadable_plan(tmp_path: Path) -> None:
    import json

    from recserve.sharding import ShardingPlan

    out = _run("-m", "recserve", "shard", "plan", "--out", str(tmp_path / "plan.json"), "--shards", "3", "--version", "4", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    plan = ShardingPlan.load(tmp_path / "plan.json")
    assert (plan.num_shards, plan.version) == (3, 4)
    assert sorted(plan.tables) == sorted(t.name for t in default_config().tables)
    assert len(doc["unique_rows_per_shard"]) == 3 and doc["imbalance"] >= 1.0


def test_demo_runs_catalog_and_lookups_end_to_end() -> None:
    out = _run("-m", "recserve", "demo", "--users", "500", "--callers", "16")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "users       500" in out.stdout
    assert "pooled output equals TorchRec EmbeddingBagCollection: True" in out.stdout
    assert "DLRM scores on remote embeddings equal in-process DLRM: True" in out.stdout
    for key in ("dlrm_auc", "l3_auc", "ground_truth_auc", "popularity_auc", "two_tower_recall_at_100", "popularity_recall_at_100"):
        assert key in out.stdout  # the metrics table of the tiny trained model set
    assert "degraded    0 callers" in out.stdout
    http = out.stdout.split("== one recommendation over HTTP (recserve gateway serve) ==\n")[1]  # through the gateway
    assert "curl -s -X POST http://127.0.0.1:" in http and len(http.split("items [")[1].split("]")[0].split(",")) == 5
    ratio = float(out.stdout.split("dedup ratio ")[1].split()[0])
    assert ratio > 1.0
    # One explanation of the top recommended item, streamed from POST /v1/generate.
    top = int(http.split("items [")[1].split(",")[0])
    explained = out.stdout.split(f"top recommended item {top:,} (category ")[1]
    assert "curl -sN -X POST http://127.0.0.1:" in explained and f"item {top} is in category" in explained
    tokens, reason = explained.split(" tokens, first after ")[0].rsplit("\n", 1)[1], explained.split("finish_reason ")[1].split()[0]
    assert int(tokens) >= 1 and reason in ("stop", "length")


def test_shard_info_on_an_unreachable_address_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    from recserve.cli.main import main

    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["shard", "info", "--address", f"127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert f"--address '127.0.0.1:{port}'" in err and "UNAVAILABLE" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("flag", ["--callers", "--users-per-caller"])
def test_demo_refuses_a_non_positive_count_before_doing_any_work(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    from recserve.cli.main import main

    with pytest.raises(SystemExit) as exit_info:  # argparse's usage error, before any catalog is built
        main(["demo", flag, "0"])
    assert exit_info.value.code == 2
    assert f"argument {flag}: '0' is not a positive integer" in capsys.readouterr().err
