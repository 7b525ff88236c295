#!/usr/bin/env bash
# Regenerates the hash-pinned lock files the Dockerfile installs from:
#
#   hack/images/requirements-operator.txt  every runtime dependency of the operator image:
#                                          pyproject.toml's [project].dependencies, resolved
#   hack/images/requirements-build.txt     what builds the rankguard wheel in the image:
#                                          pyproject.toml's [build-system].requires
#
#   hack/images/lock.sh                          keep the pins that still fit, add what is new
#   hack/images/lock.sh --upgrade                move every pin to the newest release
#   hack/images/lock.sh --upgrade-package kopf   move one
#
# Extra arguments go to `uv pip compile`. The resolution is universal (environment markers,
# not this machine's Python) for every Python pyproject.toml allows, and each pin carries the
# hashes of all its files on PyPI, so one lock serves the upstream python:3.12 base and
# Debian's python3 3.11 (hack/images/make-bases.sh) alike. uv is installed, pinned, into
# ${RANKGUARD_CACHE:-~/.cache/rankguard}/tools, outside the repository.
# tests/images/test_lock.py fails when pyproject.toml and these files name different packages.
set -euo pipefail
cd "$(dirname "$0")/../.."
UV_VERSION=0.13.8
tools="${RANKGUARD_CACHE:-$HOME/.cache/rankguard}/tools"
if [ "$("$tools/bin/uv" --version 2>/dev/null)" != "uv $UV_VERSION" ]; then
    python3 -m venv "$tools"
    "$tools/bin/pip" install -q "uv==$UV_VERSION"
fi
pyproject() {  # pyproject KEY...: a value of pyproject.toml, lists one item a line
    python3 -c 'import sys, tomllib
v = tomllib.load(open("pyproject.toml", "rb"))
for k in sys.argv[1:]:
    v = v[k]
print("\n".join(v) if isinstance(v, list) else v)' "$@"
}
requires_python=$(pyproject project requires-python)
compile=("$tools/bin/uv" pip compile --quiet --universal --python-version "${requires_python#>=}"
    --generate-hashes --custom-compile-command "hack/images/lock.sh")
"${compile[@]}" --output-file hack/images/requirements-operator.txt pyproject.toml "$@"
pyproject build-system requires | "${compile[@]}" --output-file hack/images/requirements-build.txt - "$@"
