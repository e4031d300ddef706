# recserve's container image: every recserve process (shard, ranker, cascade, generation,
# gateway) runs from it; its entrypoint is `recserve`, so a pod's args are the subcommand
# (`shard serve ...`, as `recserve deploy render` writes them).
#
#   docker build -t recserve:latest .                           # fbgemm's CPU build
#   docker build --build-arg FBGEMM_VARIANT=cuda -t recserve:cuda .   # CUDA fbgemm for GPU rankers
#
# Two stages: the build stage installs into /opt/venv with scripts/install.sh, the same
# script `make` runs (the lock exactly, fbgemm by variant, torchrec --no-deps, recserve);
# the runtime stage is the slim base plus that virtualenv, run as a non-root user.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG FBGEMM_VARIANT=cpu
WORKDIR /src
RUN python -m venv /opt/venv
COPY requirements.lock pyproject.toml ./
COPY scripts/install.sh scripts/install.sh
COPY recserve recserve
COPY embedding_server embedding_server
COPY ranker ranker
COPY cascade cascade
COPY generation generation
RUN sh scripts/install.sh /opt/venv/bin/python "${FBGEMM_VARIANT}" package

FROM ${PYTHON_IMAGE}
# The uid/gid the rendered pods run as (recserve.deploy.manifests.RUN_AS_USER).
RUN groupadd --gid 10001 recserve && useradd --uid 10001 --gid 10001 --home-dir /home/recserve --create-home --shell /usr/sbin/nologin recserve
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/recserve
ENTRYPOINT ["recserve"]
CMD ["--help"]
