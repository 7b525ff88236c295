#!/usr/bin/env bash
# The image step (the end of `make test`, and `make images-check` alone): build both images
# and run them.
#
#   bash hack/images/ci-check.sh
#
# 1. A Docker engine: the one that answers `docker info`, or else (as root) docker.io from
#    apt-get when missing and `dockerd --storage-driver=vfs` started here, and stopped again
#    at the end. Not root and no engine: SKIPPED (exit 0, said loudly), or FAIL with
#    RANKGUARD_REQUIRE_IMAGES=1 (what .ci/run sets).
# 2. `make images LOCAL_BASES=1`: bases made from Debian (hack/images/make-bases.sh, cached),
#    because CI cannot reach Docker Hub. LOCAL_BASES=0 builds on the upstream bases instead.
# 3. hack/images/check_images.py with the repository's Python: the operator image's contents,
#    the operator image against a real control plane (the Deployment rendered, a status with a
#    phase), the agent image's bundle launching a child. It prints PASS or FAIL per check.
#
# The last line says PASS or FAIL and the time taken; the exit status is 0 only on PASS.
# Environment: DOCKER, LOCAL_BASES, IMAGE_REPO, IMAGE_TAG (as `make images`), RANKGUARD_REQUIRE_IMAGES.
set -euo pipefail
cd "$(dirname "$0")/../.."
started=$SECONDS
DOCKER=${DOCKER:-docker}
LOCAL_BASES=${LOCAL_BASES:-1}
IMAGE_REPO=${IMAGE_REPO:-rankguard}
IMAGE_TAG=${IMAGE_TAG:-dev}

say() { echo "ci-check: $*" >&2; }
fail() {
    say "FAIL: $* ($((SECONDS - started)) s)"
    exit 1
}

dockerd_pid=""
dockerd_log=""
stop_engine() {
    if [ -n "$dockerd_pid" ] && kill -0 "$dockerd_pid" 2>/dev/null; then
        say "stopping the dockerd this step started (pid $dockerd_pid)"
        kill "$dockerd_pid"
        for _ in $(seq 60); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.5; done
    fi
    [ -z "$dockerd_log" ] || rm -f "$dockerd_log"
}
trap stop_engine EXIT

# --------------------------------------------------------------------------- 1. engine
if ! "$DOCKER" info >/dev/null 2>&1; then
    if [ "$(id -u)" -ne 0 ]; then
        # A developer's `make test` without Docker: say so loudly, as the GPU tests do. CI
        # (.ci/run) sets RANKGUARD_REQUIRE_IMAGES=1, where this is a failure.
        [ "${RANKGUARD_REQUIRE_IMAGES:-0}" = 1 ] &&
            fail "no Docker engine answers '$DOCKER info', and starting one needs root"
        say "SKIPPED: no Docker engine answers '$DOCKER info' and starting one needs root;" \
            "the images were not built nor run (make images-check as root, or with Docker, runs them)"
        exit 0
    fi
    if ! command -v dockerd >/dev/null || ! command -v "$DOCKER" >/dev/null; then
        command -v apt-get >/dev/null || fail "no Docker engine, and no apt-get to install docker.io"
        say "installing docker.io"
        apt-get install -y -qq docker.io >/dev/null 2>&1 ||
            { apt-get update -qq && apt-get install -y -qq docker.io >/dev/null; } ||
            fail "apt-get install docker.io failed"
    fi
    dockerd_log=$(mktemp "${TMPDIR:-/tmp}/rankguard-dockerd.XXXXXX.log")
    say "starting dockerd --storage-driver=vfs (log: $dockerd_log)"
    dockerd --storage-driver=vfs >"$dockerd_log" 2>&1 &
    dockerd_pid=$!
    for _ in $(seq 60); do
        "$DOCKER" info >/dev/null 2>&1 && break
        kill -0 "$dockerd_pid" 2>/dev/null || break
        sleep 1
    done
    if ! "$DOCKER" info >/dev/null 2>&1; then
        tail -n 20 "$dockerd_log" >&2
        fail "dockerd did not answer within 60 s (its log above)"
    fi
fi

# --------------------------------------------------------------------------- 2. build
make --no-print-directory install testbin >/dev/null || fail "make install testbin"
make --no-print-directory images LOCAL_BASES="$LOCAL_BASES" IMAGE_REPO="$IMAGE_REPO" IMAGE_TAG="$IMAGE_TAG" ||
    fail "make images"
if [ "$LOCAL_BASES" = 1 ]; then
    python_base=$(hack/images/make-bases.sh --print 2>/dev/null | sed -n 's/.*PYTHON_BASE=\([^ ]*\).*/\1/p')
else
    python_base=$(sed -n 's/^ARG PYTHON_BASE=//p' Dockerfile)
fi
say "built in $((SECONDS - started)) s"

# --------------------------------------------------------------------------- 3. run
.venv/bin/python hack/images/check_images.py --operator "$IMAGE_REPO/operator:$IMAGE_TAG" \
    --agent "$IMAGE_REPO/agent:$IMAGE_TAG" --python-base "$python_base" ||
    fail "the image checks (above)"
say "PASS: both images built and ran ($((SECONDS - started)) s)"
