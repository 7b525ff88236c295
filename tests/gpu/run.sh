#!/usr/bin/env bash
# The agent's GPU checks, in one command, on a machine with an NVIDIA GPU:
#   bash tests/gpu/run.sh            (PYTHON=/path/to/python chooses the interpreter)
# Needs a Python with torch (CUDA build). If pynvml, aiohttp, prometheus_client or pytest
# are missing, they go into a throwaway venv that reuses the system's torch; the chosen
# interpreter itself is never modified.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
NEEDS="import pynvml, aiohttp, prometheus_client, pytest"
if ! "$PY" -c "$NEEDS" 2>/dev/null; then
  VENV="${TMPDIR:-/tmp}/rankguard-gpu-venv"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
  "$VENV/bin/python" -c "$NEEDS" 2>/dev/null \
    || "$VENV/bin/python" -m pip install --quiet nvidia-ml-py aiohttp prometheus_client pytest \
    || { echo "run.sh: cannot install nvidia-ml-py aiohttp prometheus_client pytest" >&2; exit 2; }
  PY="$VENV/bin/python"
fi
export PYTHONPATH="agent${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_ORDER="${CUDA_DEVICE_ORDER:-PCI_BUS_ID}"
# --confcutdir: the cluster tests' conftest (kubernetes client) is not needed here.
exec "$PY" -m pytest tests/gpu -q -rs -s -p no:cacheprovider --confcutdir=tests/gpu "$@"
