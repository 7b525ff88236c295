#!/usr/bin/env bash
# Builds the control-plane binaries the tests run against (etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kubectl, helm) from Go modules, into a versioned
# cache OUTSIDE the repo, and prints that folder on stdout (the last line).
#
# Idempotent: a binary that is present and answers --version is not rebuilt.
# Safe against concurrent runs: the whole build holds an flock on the cache folder.
# Why from source: there is no Docker engine (no kind) and no download of release
# tarballs here; the Go module proxy is the one way in. See docs/development.md.
set -euo pipefail

K8S_VERSION=v1.34.4
ETCD_VERSION=v3.6.16
HELM_VERSION=v3.22.0

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache_root=${RANKGUARD_TESTBIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rankguard/testbin}
bin="$cache_root/k8s-${K8S_VERSION}_etcd-${ETCD_VERSION}_helm-${HELM_VERSION}"

if [ "${1:-}" = "--dir" ]; then echo "$bin"; exit 0; fi  # where the binaries are (or will be)

fail() { echo "hack/testbin/build.sh: $*" >&2; exit 1; }

command -v go >/dev/null 2>&1 ||
  fail "Go is not installed or not on PATH; install Go >= 1.24 (https://go.dev/doc/install) and run again."
command -v flock >/dev/null 2>&1 || fail "flock (util-linux) is missing; install util-linux and run again."

mkdir -p "$bin" || fail "cannot create the cache folder $bin; set RANKGUARD_TESTBIN_CACHE to a writable folder."
exec 9>"$bin/.lock"
flock 9

answers() { # answers NAME: the binary exists and prints a version
  local name=$1 args=(--version)
  case $name in helm) args=(version) ;; kubectl) args=(version --client) ;; esac
  [ -x "$bin/$name" ] && "$bin/$name" "${args[@]}" >/dev/null 2>&1
}

export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod
# The default, but spelled out so a missing proxy fails with our message below.
export GOPROXY=${GOPROXY:-https://proxy.golang.org,direct}

gobuild() { # gobuild MODULE_DIR OUTPUT LDFLAGS PACKAGES... (OUTPUT: a folder ending in / or a file)
  local dir=$1 out=$2 ld=$3; shift 3
  (cd "$here/$dir" && go mod download 2>"$bin/.download.log") ||
    fail "downloading the Go modules for $dir failed (is the Go module proxy $GOPROXY reachable?): $(tail -n 3 "$bin/.download.log")"
  (cd "$here/$dir" && go build -trimpath -ldflags "$ld" -o "$out" "$@") ||
    fail "go build of $* failed; see the output above."
}

started=$(date +%s)
missing=()
for b in kube-apiserver kube-controller-manager kube-scheduler kubectl; do answers "$b" || missing+=("$b"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "building ${missing[*]} $K8S_VERSION into $bin (a cold build takes a while)" >&2
  minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
  ld="-s -w"
  for kv in gitVersion=$K8S_VERSION gitMajor=1 gitMinor=$minor gitTreeState=clean gitCommit=none \
    buildDate=2025-01-01T00:00:00Z; do
    ld="$ld -X k8s.io/component-base/version.$kv -X k8s.io/client-go/pkg/version.$kv"
  done
  pkgs=(); for b in "${missing[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$b"); done
  gobuild kubernetes "$bin/" "$ld" "${pkgs[@]}"
fi
if ! answers etcd; then
  echo "building etcd $ETCD_VERSION into $bin" >&2
  gobuild etcd "$bin/etcd" "-s -w" go.etcd.io/etcd/server/v3
fi
if ! answers helm; then
  echo "building helm $HELM_VERSION into $bin" >&2
  gobuild helm "$bin/helm" "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" helm.sh/helm/v3/cmd/helm
fi
for b in etcd kube-apiserver kube-controller-manager kube-scheduler kubectl helm; do
  answers "$b" || fail "$bin/$b does not answer --version after the build"
done
echo "testbin ready in $(( $(date +%s) - started ))s" >&2
echo "$bin"
