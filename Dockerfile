# rankguard images. Two targets:
#
#   docker build --target operator -t ghcr.io/rankguard/operator:0.1.0 .
#   docker build --target agent    -t ghcr.io/rankguard/agent:0.1.0 .
#
# (`make images` builds both; docs/development.md, "Images".)
#
# operator: the kopf operator (`python -m rankguard_operator`), configured by RANKGUARD_* env
#           (the Helm chart sets them). It holds the rankguard_operator and rankguard_agent
#           packages and their locked runtime dependencies: not the sandbox (sim/ is not in the
#           build context, so the wheel built here has no rankguard_sim) and no test extras.
# agent:    only the pure-Python agent bundle (rankguard_agent, pynvml from nvidia-ml-py, and
#           the entry file `rankguard-agent` at its root) and `rankguard-agent-install DEST`,
#           which copies it into DEST. The operator runs it as the init container of every
#           serving pod, with an emptyDir at DEST; the vLLM container then runs
#           `python3 DEST/rankguard-agent launch … -- vllm serve …` on the vLLM image's own
#           Python (>= 3.10), aiohttp, prometheus_client and PyYAML. No PYTHONPATH: Python puts
#           the entry's folder first on sys.path, and the engine inherits nothing of the bundle.
#           If the agent cannot start there, the entry (stdlib only, Python >= 3.8) runs the
#           engine without it (docs/agent.md, "When the agent cannot start").
#
# Base images are build arguments whose defaults are pinned by full version tag, so a rebuild
# picks up Debian security fixes of that version. A release build pins by digest as well
# (--build-arg PYTHON_BASE=python:3.12.12-slim-bookworm@sha256:…), so the bytes it was tested
# with are the bytes it ships. A mirror or an air-gapped build passes its own bases the same
# way; hack/images/make-bases.sh makes two from Debian bookworm with debootstrap (`make images
# LOCAL_BASES=1`). PYTHON_BASE needs `python3` with the venv module (Debian's python3-venv),
# groupadd and useradd; AGENT_BASE needs a POSIX sh, cp, mkdir, printf and chmod.
#
# Python packages come from hash-pinned lock files (hack/images/requirements-*.txt, written by
# hack/images/lock.sh): pip refuses anything whose hash is not in them.
#
# Lint: tests/unit/house/test_chart_static.py runs hadolint on this file.
ARG PYTHON_BASE=python:3.12.12-slim-bookworm
ARG AGENT_BASE=busybox:1.37.0

# --------------------------------------------------------------------------- base
FROM ${PYTHON_BASE} AS python-base

# --------------------------------------------------------------------------- agent
# The agent's stages come first: the classic builder runs every stage before its target, so
# `--target agent` then skips the operator's (whose venv copy alone takes half a minute to
# check against the cache on a vfs engine).
#
# The agent bundle: what the serving pod's agent imports, its entry, and nothing else.
# nvidia-ml-py's wheel also ships a top-level `example.py`; it is dropped so that nothing
# named `example` shadows a module of the vLLM image. No .pyc: the bundle runs on whatever
# Python the vLLM image has, and writes its own caches into the emptyDir. The version is the
# operator lock's (tests/images/test_lock.py holds them equal).
FROM python-base AS agent-build
ARG NVIDIA_ML_PY_VERSION=13.615.71
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
COPY agent/rankguard_agent/ /bundle/rankguard_agent/
COPY agent/rankguard-agent /bundle/rankguard-agent
RUN python3 -m venv /opt/build \
    && /opt/build/bin/pip install --no-deps --no-compile --target /bundle "nvidia-ml-py==${NVIDIA_ML_PY_VERSION}" \
    && rm -f /bundle/example.py \
    && rm -rf /bundle/bin \
    && find /bundle -name __pycache__ -prune -exec rm -rf {} + \
    && chmod -R a+rX,go-w /bundle

FROM ${AGENT_BASE} AS agent
LABEL org.opencontainers.image.title="rankguard agent" \
      org.opencontainers.image.description="The rankguard agent bundle, copied into vLLM pods by an init container" \
      org.opencontainers.image.licenses="Apache-2.0"
# The bundle lives outside /opt/rankguard/agent on purpose: that is where the serving pod
# mounts the emptyDir, which would hide anything the image kept there.
COPY --from=agent-build /bundle /usr/share/rankguard/agent-bundle
# rankguard-agent-install DEST: copies the bundle into DEST (an emptyDir mounted there).
# cp -R, not cp -a: the copy belongs to the pod's user, whatever UID the pod runs as.
# The single quotes are on purpose: "$1" and "$dest" belong to the installed script.
# hadolint ignore=SC2016
RUN mkdir -p /usr/local/bin \
    && printf '%s\n' \
       '#!/bin/sh' \
       '# Copies the rankguard agent bundle into DEST (an emptyDir shared with the vLLM container).' \
       'set -eu' \
       'if [ "$#" -ne 1 ]; then echo "usage: rankguard-agent-install DEST" >&2; exit 2; fi' \
       'dest=$1' \
       'if [ ! -d "$dest" ] || [ ! -w "$dest" ]; then' \
       '  echo "rankguard-agent-install: $dest is not a writable directory (mount an emptyDir there)" >&2' \
       '  exit 1' \
       'fi' \
       'cp -R /usr/share/rankguard/agent-bundle/. "$dest"/' \
       'echo "rankguard-agent-install: agent bundle copied into $dest"' \
       > /usr/local/bin/rankguard-agent-install \
    && chmod 0755 /usr/local/bin/rankguard-agent-install
USER 65532:65532
ENTRYPOINT ["rankguard-agent-install"]
CMD ["/opt/rankguard/agent"]

# --------------------------------------------------------------------------- operator
# The operator's virtualenv: the locked runtime dependencies, then the rankguard wheel without
# its dependencies (`pip check` proves the lock satisfies them), then pip and setuptools go
# (Python 3.11's venv brings both, 3.12's pip only). The wheel is built in a separate venv
# from the build lock, so no unpinned build tool is fetched. The venv is copied whole into the
# final stage, which has the same Python at the same path, so the venv's interpreter links stay
# valid. `python3`, never `python`: Debian's own Python has only the former.
FROM python-base AS operator-build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY hack/images/requirements-build.txt hack/images/requirements-operator.txt /locks/
RUN python3 -m venv /opt/build \
    && /opt/build/bin/pip install --require-hashes -r /locks/requirements-build.txt \
    && python3 -m venv /opt/rankguard/venv \
    && /opt/rankguard/venv/bin/pip install --require-hashes -r /locks/requirements-operator.txt
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY agent/ agent/
RUN /opt/build/bin/pip wheel --no-deps --no-build-isolation --wheel-dir /wheels . \
    && /opt/rankguard/venv/bin/pip install --no-deps /wheels/rankguard-*.whl \
    && /opt/rankguard/venv/bin/pip check \
    && /opt/rankguard/venv/bin/pip uninstall --yes pip setuptools

FROM python-base AS operator
LABEL org.opencontainers.image.title="rankguard operator" \
      org.opencontainers.image.description="Keeps every tensor-parallel rank of a vLLM deployment out of GPU OOM" \
      org.opencontainers.image.licenses="Apache-2.0"
# pip is a build tool: the operator never installs anything at run time (the upstream base
# has one; Debian's python3 has none).
RUN if python3 -m pip --version >/dev/null 2>&1; then python3 -m pip uninstall --yes pip; fi \
    && groupadd --system --gid 65532 rankguard \
    && useradd --system --uid 65532 --gid 65532 --no-log-init --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin rankguard
COPY --from=operator-build /opt/rankguard/venv /opt/rankguard/venv
ENV PATH=/opt/rankguard/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Numeric, so the kubelet can verify runAsNonRoot without reading /etc/passwd.
USER 65532:65532
# kopf's /healthz (RANKGUARD_LIVENESS_PORT) and Prometheus /metrics (RANKGUARD_METRICS_PORT).
EXPOSE 8080 9090
ENTRYPOINT ["python", "-m", "rankguard_operator"]
