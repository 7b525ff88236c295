#!/usr/bin/env bash
# Builds both images of the Dockerfile: what `make images` runs.
#
#   make images                      upstream bases (the Dockerfile's pinned defaults)
#   make images LOCAL_BASES=1        bases made from Debian by hack/images/make-bases.sh, for a
#                                    machine that cannot reach Docker Hub
#   make images IMAGE_REPO=ghcr.io/rankguard IMAGE_TAG=0.1.0   the chart's names
#
# Environment: OPERATOR_IMAGE, AGENT_IMAGE (default rankguard/operator:dev, rankguard/agent:dev),
# LOCAL_BASES (1 = local bases), DOCKER_BUILD_NETWORK (default host: the build's RUN steps use
# the host's network, which works where the engine's bridge has no route out),
# DOCKER_BUILD_FLAGS (more flags for both builds, e.g. --build-arg PYTHON_BASE=mirror/python:…).
set -euo pipefail
cd "$(dirname "$0")/../.."
DOCKER=${DOCKER:-docker}
OPERATOR_IMAGE=${OPERATOR_IMAGE:-rankguard/operator:dev}
AGENT_IMAGE=${AGENT_IMAGE:-rankguard/agent:dev}

if ! "$DOCKER" info >/dev/null 2>&1; then
    echo "images: no Docker engine answers ($DOCKER info failed); hack/images/ci-check.sh can start one" >&2
    exit 1
fi
flags=(--network "${DOCKER_BUILD_NETWORK:-host}")
if [ "${LOCAL_BASES:-0}" = 1 ]; then
    read -r -a bases <<<"$(hack/images/make-bases.sh --print)"
    flags+=("${bases[@]}")
fi
if [ -n "${DOCKER_BUILD_FLAGS:-}" ]; then
    read -r -a extra <<<"$DOCKER_BUILD_FLAGS"
    flags+=("${extra[@]}")
fi
log=$(mktemp "${TMPDIR:-/tmp}/rankguard-images.XXXXXX.log")
trap 'rm -f "$log"' EXIT
for target in operator agent; do
    image=$OPERATOR_IMAGE
    [ "$target" = agent ] && image=$AGENT_IMAGE
    started=$SECONDS
    echo "images: docker build --target $target -t $image ${flags[*]} ." >&2
    if ! "$DOCKER" build "${flags[@]}" --target "$target" -t "$image" . >"$log" 2>&1; then
        tail -n 40 "$log" >&2
        echo "images: building $image failed (the build's last lines above)" >&2
        exit 1
    fi
    size=$("$DOCKER" image inspect --format '{{.Size}}' "$image")
    echo "images: $image built in $((SECONDS - started)) s, $((size / 1000000)) MB" >&2
done
