# One image for every Gyre service (scheduler, trajectory, trainer, rollout) and the `gyre` command.
#
#   docker build -t gyre .                          # CPU torch (default, ~1 GB)
#   docker build -t gyre:gpu --build-arg GYRE_EXTRAS=gpu .   # vLLM + the CUDA torch it pins
#
# BASE_IMAGE: any Debian-like image with Python 3.11 and its venv module (default the official
# python:3.11-slim). Where no registry answers, scripts/compose_stack.sh builds one from Debian's
# packages (gyre-base:local, with the host's CA certificates) and passes it here.
#
# The project pins torch==2.13.0 (the CPU build CI machines have on disk) while vLLM pins its own
# CUDA torch, so the image installs torch (or the gpu extra, which brings its torch) first and
# then every other dependency with torch left out, and installs Gyre itself without re-resolving.
# A CPU torch wheel put in deploy/images/wheels/ (scripts/compose_stack.sh copies the host's) is
# installed instead of downloading one. Dependencies go into the venv /opt/venv of a build stage;
# the runtime stage copies the venv alone, so no wheel or pip cache is left in the image.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS deps

ARG GYRE_EXTRAS=""
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

WORKDIR /build
# Dependency layer: changes only when pyproject.toml, the staged wheel or the build args change.
COPY pyproject.toml ./
COPY deploy/images/wheels/ /tmp/wheels/
RUN python3 -m venv /opt/venv \
    && if [ "$GYRE_EXTRAS" = "gpu" ]; then \
        python -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb')); print('\n'.join(d['project']['optional-dependencies']['gpu']))" > /tmp/torch.txt \
        && pip install -r /tmp/torch.txt; \
    elif ls /tmp/wheels/torch-"${TORCH_VERSION}"+cpu-*.whl >/dev/null 2>&1; then \
        pip install /tmp/wheels/torch-"${TORCH_VERSION}"+cpu-*.whl; \
    else \
        pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"; \
    fi \
    && python -c "import re, tomllib; d = tomllib.load(open('pyproject.toml', 'rb')); print('\n'.join(r for r in d['project']['dependencies'] if re.split(r'[<>=!~ ;\\[]', r, maxsplit=1)[0] != 'torch'))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && pip install "setuptools>=68" wheel

FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    GYRE_RUN_DIR=/data/run

WORKDIR /app

# tini reaps zombies and forwards SIGTERM, so `docker stop` drains a service gracefully.
RUN if [ ! -x /usr/bin/tini ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends tini \
        && rm -rf /var/lib/apt/lists/*; \
    fi

COPY --from=deps /opt/venv /opt/venv
COPY pyproject.toml README.md ./
COPY gyre ./gyre
COPY services ./services
COPY app ./app
COPY proto ./proto
COPY scripts ./scripts
COPY examples ./examples
COPY deploy/run.yaml /etc/gyre/run.yaml
# Editable: the services' Alembic version scripts are plain files, not packages, and must stay in place.
# No build isolation: setuptools is in the venv, so this step needs no download.
RUN pip install --no-deps --no-build-isolation -e . && mkdir -p /data/run

# gRPC (health + the service's API) and Prometheus /metrics.
EXPOSE 50051 9090
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["gyre", "--help"]
