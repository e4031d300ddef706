"""The ``recserve`` command as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
