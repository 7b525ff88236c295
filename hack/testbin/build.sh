#!/usr/bin/env bash
# Builds the control-plane binaries the tests run against (etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kubectl, helm), promtool (the alert rules'
# checker) and the LeaderWorkerSet controller (lws-controller) from Go modules, into a versioned cache OUTSIDE the repo, and prints the control
# plane's folder on stdout (the last line).
#
#   build.sh            build what is missing, print the folder
#   build.sh --dir      print the folder only (where the binaries are, or will be)
#
# promtool lives in a folder of its own beside the control plane's (so that a new Prometheus
# release never forces the 10-minute Kubernetes rebuild, and the other way round) and is
# linked into the control plane's folder as `promtool`, next to kubectl. The LeaderWorkerSet
# controller likewise (its folder `lws-<version>`, linked as `lws-controller`).
#
# LWS is v0.9.0, not v0.10.0 (the release whose CRD third_party/lws/v0.10.0 vendors): the Go
# module proxy answers `go mod download sigs.k8s.io/lws@v0.10.0` with "403 Forbidden: This module
# version is not available" (checked 2026-12-07; its .info and .mod are served, its zip is not),
# and serves v0.9.0. For what rankguard relies on the two are the same: the owner chain (the
# leader StatefulSet's controller is the LWS, a worker set's the leader pod), the names, the
# labels and the variables the pod webhook injects (third_party/lws/README.md compares them).
# Its CRDs are the v0.9.0 ones, vendored in third_party/lws/v0.9.0.
#
# Idempotent: a binary that is present and answers --version is not rebuilt.
# Safe against concurrent runs: the whole build holds an flock on the cache folder.
# While a build runs, a line on stderr every 30 s (RANKGUARD_TESTBIN_TICK_SECONDS) says what
# is being built, for how long, and how long it usually takes.
# Why from source: there is no Docker engine (no kind) and no download of release
# tarballs here; the Go module proxy is the one way in. See docs/development.md.
set -euo pipefail

K8S_VERSION=v1.34.4
ETCD_VERSION=v3.6.16
HELM_VERSION=v3.22.0
PROMETHEUS_VERSION=v0.316.0  # the Go module's version; promtool --version says 3.16.0
LWS_VERSION=v0.9.0  # v0.10.0's module zip is refused by the proxy (see above)
LWS_COMMIT=f056f611ae7721f9983ac35f26bfbae8547fd9f3  # the tag's commit (the proxy's .info Origin)

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache_root=${RANKGUARD_TESTBIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rankguard/testbin}
# Never rename this folder: every machine would rebuild everything (10+ minutes).
bin="$cache_root/k8s-${K8S_VERSION}_etcd-${ETCD_VERSION}_helm-${HELM_VERSION}"
prom="$cache_root/prometheus-${PROMETHEUS_VERSION}"
lws="$cache_root/lws-${LWS_VERSION}"

if [ "${1:-}" = "--dir" ]; then echo "$bin"; exit 0; fi  # where the binaries are (or will be)

# How long a cold build takes on 2 cores (docs/development.md, "Measured"); said up front and
# with every progress line, so a quiet terminal is not taken for a hung one.
EXPECT_K8S="usually 4-5 min on 2 cores"
EXPECT_ETCD_HELM="etcd and helm together usually take 1-2 min on 2 cores"
EXPECT_PROMTOOL="usually 3-5 min on 2 cores"
EXPECT_LWS="usually 3-6 min on 2 cores"
EXPECT_ALL="a cold build of everything usually takes 8-12 min on 2 cores; later runs take a second"

say() { echo "hack/testbin/build.sh: $*" >&2; }
fail() { say "$*"; exit 1; }

GO_MIN=1.26.7  # the Prometheus module's go directive; the others need 1.26.0
command -v go >/dev/null 2>&1 ||
  fail "Go is not installed or not on PATH; install Go >= $GO_MIN (https://go.dev/doc/install) and run again."
go_version=$(go env GOVERSION 2>/dev/null || true)
go_version=${go_version#go}
[ "$(printf '%s\n%s\n' "$GO_MIN" "${go_version:-0}" | sort -V | head -n 1)" = "$GO_MIN" ] ||
  fail "Go ${go_version:-of an unknown version} is too old; install Go >= $GO_MIN (https://go.dev/doc/install) and run again."
command -v flock >/dev/null 2>&1 || fail "flock (util-linux) is missing; install util-linux and run again."

mkdir -p "$bin" "$prom" "$lws" ||
  fail "cannot create the cache folders under $cache_root; set RANKGUARD_TESTBIN_CACHE to a writable folder."
exec 9>"$bin/.lock"
if ! flock -n 9; then
  say "another build.sh holds $bin/.lock (building the same binaries); waiting for it"
  flock 9
fi

# The progress ticker: a background loop that prints the elapsed time every 30 s while one
# step runs, killed when the step ends (and on any exit, a failure included).
ticker=
tick_start() { # tick_start WHAT EXPECTED
  local what=$1 expect=$2 t0
  t0=$(date +%s)
  say "building $what ($expect)"
  # fd 9 (the lock) is closed in the ticker, and its sleep writes nowhere, so neither can hold
  # the lock or a caller's stderr pipe open after the ticker is killed.
  # It also ends by itself once this script is gone (killed with SIGKILL, say).
  (
    nap=
    trap 'kill "$nap" 2>/dev/null; exit 0' TERM
    while :; do
      sleep "${RANKGUARD_TESTBIN_TICK_SECONDS:-30}" >/dev/null 2>&1 &
      nap=$!
      wait "$nap"
      kill -0 $$ 2>/dev/null || exit 0
      say "still building $what: $(($(date +%s) - t0))s so far ($expect)"
    done
  ) 9>&- &
  ticker=$!
}
tick_stop() {
  if [ -n "$ticker" ]; then
    kill "$ticker" 2>/dev/null || true
    wait "$ticker" 2>/dev/null || true
    ticker=
  fi
}
trap tick_stop EXIT

answers() { # answers PATH: the binary exists and prints a version
  local path=$1 args=(--version)
  case ${path##*/} in helm) args=(version) ;; kubectl) args=(version --client) ;; esac
  [ -x "$path" ] && "$path" "${args[@]}" >/dev/null 2>&1
}

export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod
# The default, but spelled out so a missing proxy fails with our message below.
export GOPROXY=${GOPROXY:-https://proxy.golang.org,direct}

gobuild() { # gobuild MODULE_DIR OUTPUT LDFLAGS [-tags TAGS] PACKAGES... (OUTPUT: a folder ending in / or a file)
  local dir=$1 out=$2 ld=$3; shift 3
  # Only the modules these packages need (not every module in the graph: for Prometheus that
  # is 1 GB less), fetched first so that a proxy failure gets the message below.
  (cd "$here/$dir" && go list -deps "$@" >/dev/null 2>"$bin/.download.log") ||
    fail "downloading the Go modules for $dir failed (is the Go module proxy $GOPROXY reachable?): $(tail -n 3 "$bin/.download.log")"
  (cd "$here/$dir" && go build -trimpath -ldflags "$ld" -o "$out" "$@") ||
    fail "go build of $* failed; see the output above."
}

started=$(date +%s)
missing=()
for b in kube-apiserver kube-controller-manager kube-scheduler kubectl; do answers "$bin/$b" || missing+=("$b"); done
[ ${#missing[@]} -eq 0 ] || say "building the test binaries into $cache_root ($EXPECT_ALL)"

if [ ${#missing[@]} -gt 0 ]; then
  minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
  ld="-s -w"
  for kv in gitVersion=$K8S_VERSION gitMajor=1 gitMinor=$minor gitTreeState=clean gitCommit=none \
    buildDate=2025-01-01T00:00:00Z; do
    ld="$ld -X k8s.io/component-base/version.$kv -X k8s.io/client-go/pkg/version.$kv"
  done
  pkgs=(); for b in "${missing[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$b"); done
  tick_start "${missing[*]} $K8S_VERSION" "$EXPECT_K8S"
  gobuild kubernetes "$bin/" "$ld" "${pkgs[@]}"
  tick_stop
fi
if ! answers "$bin/etcd"; then
  tick_start "etcd $ETCD_VERSION" "$EXPECT_ETCD_HELM"
  gobuild etcd "$bin/etcd" "-s -w" go.etcd.io/etcd/server/v3
  tick_stop
fi
# Helm's own Makefile stamps the Kubernetes version its client-go speaks (here 1.37) into
# the binary; without it `helm template` assumes Kubernetes 1.20 and refuses the chart's
# kubeVersion unless given --kube-version. The stamp file rebuilds a helm cached without it.
helm_ld="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
for pkg in pkg/chartutil pkg/lint/rules; do
  helm_ld="$helm_ld -X helm.sh/helm/v3/$pkg.k8sVersionMajor=1 -X helm.sh/helm/v3/$pkg.k8sVersionMinor=37"
done
if ! answers "$bin/helm" || [ "$(cat "$bin/.helm-ldflags" 2>/dev/null)" != "$helm_ld" ]; then
  tick_start "helm $HELM_VERSION" "$EXPECT_ETCD_HELM"
  gobuild helm "$bin/helm" "$helm_ld" helm.sh/helm/v3/cmd/helm
  echo "$helm_ld" >"$bin/.helm-ldflags"
  tick_stop
fi
if ! answers "$prom/promtool"; then
  pv=github.com/prometheus/common/version
  release=${PROMETHEUS_VERSION#v0.}  # module v0.316.0 is Prometheus 3.16.0
  release=${release:0:1}.${release:1}
  ld="-s -w -X $pv.Version=$release -X $pv.Revision=none -X $pv.Branch=HEAD"
  ld="$ld -X $pv.BuildUser=rankguard -X $pv.BuildDate=20250101-00:00:00"
  tick_start "promtool (Prometheus module $PROMETHEUS_VERSION)" "$EXPECT_PROMTOOL"
  # remove_all_sd leaves out Prometheus' service discoveries (cloud SDKs, a Kubernetes client),
  # which promtool's rule checks and unit tests never use: less than half the compile time and
  # a third of the peak memory (docs/development.md).
  gobuild prometheus "$prom/promtool" "$ld" -tags remove_all_sd github.com/prometheus/prometheus/cmd/promtool
  tick_stop
fi
if ! answers "$lws/lws-controller"; then
  lv=sigs.k8s.io/lws/pkg/version
  ld="-s -w -X $lv.GitVersion=$LWS_VERSION -X $lv.GitCommit=$LWS_COMMIT -X $lv.BuildDate=2025-01-01T00:00:00Z"
  tick_start "the LeaderWorkerSet controller $LWS_VERSION" "$EXPECT_LWS"
  gobuild lws "$lws/lws-controller" "$ld" sigs.k8s.io/lws/cmd
  tick_stop
fi
# Next to kubectl, where sim/rankguard_sim/testbin.py and the tests look for them.
ln -sfn "$prom/promtool" "$bin/promtool"
ln -sfn "$lws/lws-controller" "$bin/lws-controller"
for b in etcd kube-apiserver kube-controller-manager kube-scheduler kubectl helm promtool lws-controller; do
  answers "$bin/$b" || fail "$bin/$b does not answer --version after the build"
done
say "testbin ready in $(($(date +%s) - started))s"
echo "$bin"
