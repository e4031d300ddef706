"""The container image installs exactly as ``make`` does: the Makefile's venv recipe and
the Dockerfile both run the one ``scripts/install.sh`` and install nothing themselves,
so they cannot drift. Docker may be absent here: these read the files; the script's
commands themselves are checked in tests/integration/test_deploy_image.py."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

from recserve.deploy.manifests import RUN_AS_USER

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "scripts/install.sh"


def _stamp_recipe() -> tuple[str, list[str]]:
    """The Makefile's ``$(STAMP):`` prerequisites line and its recipe lines."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("$(STAMP):"))
    recipe = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return lines[start], recipe


def _dockerfile() -> list[str]:
    """Dockerfile instructions, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_make_and_the_dockerfile_install_through_the_one_script() -> None:
    prereqs, recipe = _stamp_recipe()
    assert SCRIPT in prereqs.split()  # editing the script re-installs the venv
    runs = [line for line in recipe if SCRIPT in line]
    assert runs == [f"sh {SCRIPT} $(BIN)/python $(FBGEMM_VARIANT) editable"]
    assert not [line for line in recipe if "pip" in line and not line.startswith("@#")]
    docker = _dockerfile()
    installs = [line for line in docker if SCRIPT in line and line.startswith("RUN")]
    assert installs == [f'RUN sh {SCRIPT} /opt/venv/bin/python "${{FBGEMM_VARIANT}}" package']
    assert not [line for line in docker if "pip" in line]


def test_the_image_is_multi_stage_slim_non_root_with_recserve_as_entrypoint() -> None:
    docker = _dockerfile()
    froms = [line for line in docker if line.startswith("FROM")]
    assert len(froms) == 2 and froms[0].endswith("AS build")
    base = next(line for line in docker if line.startswith("ARG PYTHON_IMAGE="))
    assert "slim" in base
    assert "ARG FBGEMM_VARIANT=cpu" in docker  # the CUDA build: --build-arg FBGEMM_VARIANT=cuda
    assert "COPY --from=build /opt/venv /opt/venv" in docker
    runtime = docker[docker.index(froms[1]) :]
    user = [line for line in runtime if line.startswith("USER")]
    assert user == [f"USER {RUN_AS_USER}:{RUN_AS_USER}"]  # the uid the rendered pods run as
    assert 'ENTRYPOINT ["recserve"]' in runtime
    # Every package pyproject installs is copied into the build stage.
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = {shlex.split(line)[1] for line in docker if line.startswith("COPY") and "--from" not in line}
    assert {p.rstrip("*") for p in include} <= copied
    assert {"requirements.lock", SCRIPT} <= copied


def test_the_script_pins_match_the_lock_comment() -> None:
    """The lock's header names the versions the script installs outside it."""
    script = (ROOT / SCRIPT).read_text()
    lock = (ROOT / "requirements.lock").read_text()
    fbgemm = re.search(r"^FBGEMM_VERSION=(\S+)$", script, re.M)
    torchrec = re.search(r"^TORCHREC_VERSION=(\S+)$", script, re.M)
    assert fbgemm is not None and torchrec is not None
    assert f"torchrec=={torchrec.group(1)}" in lock and f"fbgemm-gpu=={fbgemm.group(1)}" in lock
    assert not re.search(r"^(torchrec|fbgemm-gpu(-cpu)?)==", lock, re.M)  # installed by the script only
