"""``scripts/install.sh``'s commands (dry run): the fbgemm CPU / CUDA switch and the
install steps ``make`` ran before the script existed, unchanged."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PIP = "PY -m pip install --quiet --disable-pip-version-check"


def _dry_run(*args: str, nvidia_smi_exit: int | None = None, tmp: Path | None = None) -> list[str]:
    env = {**os.environ, "RECSERVE_INSTALL_DRY_RUN": "1"}
    if nvidia_smi_exit is not None:  # a fake nvidia-smi first on PATH: a GPU box or not
        assert tmp is not None
        fake = tmp / "nvidia-smi"
        fake.write_text(f"#!/bin/sh\nexit {nvidia_smi_exit}\n")
        fake.chmod(0o755)
        env["PATH"] = f"{tmp}:{env['PATH']}"
    out = subprocess.run(["sh", "scripts/install.sh", "PY", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.splitlines()


def test_install_steps_and_the_fbgemm_switch(tmp_path: Path) -> None:
    assert _dry_run("auto", "editable", nvidia_smi_exit=1, tmp=tmp_path) == [
        f"{PIP} -r requirements.lock fbgemm-gpu-cpu==1.8.0",
        f"{PIP} --no-deps torchrec==1.8.0",
        f"{PIP} --no-deps --no-build-isolation -e .",
    ]
    assert _dry_run("auto", "editable", nvidia_smi_exit=0, tmp=tmp_path)[0] == f"{PIP} -r requirements.lock fbgemm-gpu==1.8.0"
    assert _dry_run("cuda", "package")[0].endswith("fbgemm-gpu==1.8.0")
    assert _dry_run("cpu", "package")[-1] == f"{PIP} --no-deps --no-build-isolation ."
    bad = subprocess.run(["sh", "scripts/install.sh", "PY", "rocm"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "'rocm' is invalid" in bad.stderr
