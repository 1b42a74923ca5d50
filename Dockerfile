# One image for every Gyre service (scheduler, trajectory, trainer, rollout) and the `gyre` command.
#
#   docker build -t gyre .                          # CPU torch (default, ~1 GB)
#   docker build -t gyre:gpu --build-arg GYRE_EXTRAS=gpu .   # vLLM + the CUDA torch it pins
#
# The project pins torch==2.13.0 (the CPU build CI machines have on disk) while vLLM pins its own
# CUDA torch, so the image installs torch (or the gpu extra, which brings its torch) first and
# then every other dependency with torch left out, and installs Gyre itself without re-resolving.
FROM python:3.11-slim

ARG GYRE_EXTRAS=""
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    GYRE_RUN_DIR=/data/run

WORKDIR /app

# tini reaps zombies and forwards SIGTERM, so `docker stop` drains a service gracefully.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*

# Dependency layer: changes only when pyproject.toml or the build args change.
COPY pyproject.toml README.md ./
RUN if [ "$GYRE_EXTRAS" = "gpu" ]; then \
        python -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb')); print('\n'.join(d['project']['optional-dependencies']['gpu']))" > /tmp/torch.txt \
        && pip install -r /tmp/torch.txt; \
    else \
        pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"; \
    fi \
    && python -c "import re, tomllib; d = tomllib.load(open('pyproject.toml', 'rb')); print('\n'.join(r for r in d['project']['dependencies'] if re.split(r'[<>=!~ ;\\[]', r, maxsplit=1)[0] != 'torch'))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt

COPY gyre ./gyre
COPY services ./services
COPY app ./app
COPY proto ./proto
COPY scripts ./scripts
COPY examples ./examples
COPY deploy/run.yaml /etc/gyre/run.yaml
# Editable: the services' Alembic version scripts are plain files, not packages, and must stay in place.
RUN pip install --no-deps -e . && mkdir -p /data/run

# gRPC (health + the service's API) and Prometheus /metrics.
EXPOSE 50051 9090
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["gyre", "--help"]
