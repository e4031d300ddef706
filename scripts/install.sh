#!/bin/sh
# The one install of recserve's Python environment, run by both `make` (the .venv) and
# the Dockerfile (the image's /opt/venv), so the two cannot drift
# (tests/unit/test_deploy_image.py checks that each calls this and installs nothing itself).
#
#   scripts/install.sh PYTHON [auto|cpu|cuda] [editable|package]
#
# PYTHON: the interpreter of the target virtualenv. The fbgemm variant: "auto" = the
# CUDA build where a working NVIDIA driver answers (nvidia-smi), else the CPU build;
# "cpu" / "cuda" force one (the image's FBGEMM_VARIANT build arg). "editable": the repo
# installed in place (make); "package": copied into site-packages (the image's build
# stage, whose source tree does not reach the runtime stage).
# RECSERVE_INSTALL_DRY_RUN=1 prints the commands instead of running them.
set -eu

PY=${1:?usage: scripts/install.sh PYTHON [auto|cpu|cuda] [editable|package]}
VARIANT=${2:-auto}
MODE=${3:-editable}
FBGEMM_VERSION=1.8.0
TORCHREC_VERSION=1.8.0

if [ "$VARIANT" = auto ]; then
    if nvidia-smi -L >/dev/null 2>&1; then VARIANT=cuda; else VARIANT=cpu; fi
fi
case "$VARIANT" in
    cpu) FBGEMM=fbgemm-gpu-cpu==$FBGEMM_VERSION ;;
    cuda) FBGEMM=fbgemm-gpu==$FBGEMM_VERSION ;;
    *) echo "scripts/install.sh: fbgemm variant '$VARIANT' is invalid: use auto, cpu or cuda" >&2; exit 2 ;;
esac
case "$MODE" in
    editable) TARGET="-e ." ;;
    package) TARGET="." ;;
    *) echo "scripts/install.sh: mode '$MODE' is invalid: use editable or package" >&2; exit 2 ;;
esac

run() {
    if [ "${RECSERVE_INSTALL_DRY_RUN:-}" = 1 ]; then echo "$*"; else "$@"; fi
}

PIP="$PY -m pip install --quiet --disable-pip-version-check"
# shellcheck disable=SC2086 # PIP and TARGET are word lists on purpose
run $PIP -r requirements.lock "$FBGEMM"
# torchrec's metadata pulls the multi-GB CUDA fbgemm-gpu; its real deps are in the lock.
run $PIP --no-deps "torchrec==$TORCHREC_VERSION"
run $PIP --no-deps --no-build-isolation $TARGET
