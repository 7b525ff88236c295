#!/usr/bin/env bash
# Makes the two base images the Dockerfile needs, from Debian, for a machine whose container
# registry is out of reach (no Docker Hub) but whose Debian mirror is not:
#
#   rankguard-local/python-base:bookworm   debootstrap minbase + python3 + python3-venv +
#                                          ca-certificates (Debian's Python 3.11 at
#                                          /usr/bin/python3)
#   rankguard-local/busybox:bookworm       Debian's static busybox and its applet links, alone
#
#   hack/images/make-bases.sh          make whichever is missing
#   hack/images/make-bases.sh --print  also print the --build-arg flags that use them
#
# Cached twice: an image already in the engine is kept as it is, and each root file system is
# kept as a tarball in ${RANKGUARD_CACHE:-~/.cache/rankguard}/images, named by what it holds,
# so a new engine (a CI rerun) imports it in seconds instead of running debootstrap again.
# Delete the tarballs (and `docker rmi` the images) to take newer Debian packages.
# debootstrap needs root; as root it is installed with apt-get when missing.
#
# The python base trusts what this machine trusts: the certificates of
# $RANKGUARD_EXTRA_CA_DIR (default /usr/local/share/ca-certificates, where Debian keeps local
# CAs) join its store, so pip inside the build gets through a TLS-intercepting proxy that the
# host trusts. These bases are for local and CI builds; a release builds on the upstream ones.
# Environment: RANKGUARD_DEBIAN_MIRROR (default http://deb.debian.org/debian),
# RANKGUARD_EXTRA_CA_DIR, DOCKER.
set -euo pipefail

SUITE=bookworm
MIRROR=${RANKGUARD_DEBIAN_MIRROR:-http://deb.debian.org/debian}
PACKAGES=python3,python3-venv,ca-certificates,busybox-static
EXTRA_CA_DIR=${RANKGUARD_EXTRA_CA_DIR:-/usr/local/share/ca-certificates}
PYTHON_BASE_IMAGE=rankguard-local/python-base:$SUITE
AGENT_BASE_IMAGE=rankguard-local/busybox:$SUITE
DOCKER=${DOCKER:-docker}
cache="${RANKGUARD_CACHE:-$HOME/.cache/rankguard}/images"
extra_cas() { find "$EXTRA_CA_DIR" -maxdepth 1 -name '*.crt' -type f 2>/dev/null | sort; }
# The tarballs' names say what they hold: another suite, package list or set of local CAs is
# another tarball.
key="$SUITE-$({ echo "$PACKAGES"; extra_cas | xargs -r cat; } | sha256sum | cut -c1-12)"
python_tar="$cache/python-base-$key.tar"
agent_tar="$cache/busybox-$key.tar"

say() { echo "make-bases: $*" >&2; }
have_image() { "$DOCKER" image inspect "$1" >/dev/null 2>&1; }

print=0
case "${1:-}" in
    --print) print=1 ;;
    "") ;;
    *) say "usage: $0 [--print]"; exit 2 ;;
esac

mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9  # two builds at once share one debootstrap

rootfs() {  # debootstrap once, then write both tarballs
    if [ "$(id -u)" -ne 0 ]; then
        say "debootstrap needs root, and $python_tar is not cached yet"
        exit 1
    fi
    if ! command -v debootstrap >/dev/null; then
        say "installing debootstrap"
        apt-get install -y -qq debootstrap >/dev/null || {
            apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null
        }
    fi
    local work root agent
    work=$(mktemp -d "${TMPDIR:-/tmp}/rankguard-bases.XXXXXX")
    # shellcheck disable=SC2064 # expand now: the trap must remove this run's folder
    trap "rm -rf '$work'" EXIT
    root="$work/python" agent="$work/busybox"
    say "debootstrap --variant=minbase --include=$PACKAGES $SUITE (a few minutes)"
    debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$root" "$MIRROR" \
        >"$work/debootstrap.log" 2>&1 || {
        tail -n 20 "$work/debootstrap.log" >&2
        say "debootstrap failed (log above)"
        exit 1
    }
    # The agent base: the static busybox and a link per applet, as the busybox image has.
    mkdir -p "$agent/bin" "$agent/etc" "$agent/tmp" "$agent/usr/local/bin"
    chmod 1777 "$agent/tmp"
    cp "$root/bin/busybox" "$agent/bin/busybox"
    local applet
    for applet in $("$agent/bin/busybox" --list); do
        [ "$applet" = busybox ] || ln -s busybox "$agent/bin/$applet"
    done
    local ca
    for ca in $(extra_cas); do
        cp "$ca" "$root/usr/local/share/ca-certificates/"
        say "the python base trusts $ca"
    done
    chroot "$root" update-ca-certificates >/dev/null 2>&1
    # The python base keeps neither busybox nor apt's downloads and lists.
    chroot "$root" dpkg --purge busybox-static >/dev/null
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/var/log/*.log
    tar -C "$root" --numeric-owner -cf "$python_tar.part" . && mv "$python_tar.part" "$python_tar"
    tar -C "$agent" --numeric-owner -cf "$agent_tar.part" . && mv "$agent_tar.part" "$agent_tar"
    rm -rf "$work"
    trap - EXIT
}

if ! have_image "$PYTHON_BASE_IMAGE" || ! have_image "$AGENT_BASE_IMAGE"; then
    if [ -f "$python_tar" ] && [ -f "$agent_tar" ]; then
        say "root file systems cached in $cache"
    else
        rootfs
    fi
    path=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
    if ! have_image "$PYTHON_BASE_IMAGE"; then
        "$DOCKER" import --change "ENV $path" --change "ENV LANG=C.UTF-8" \
            --change 'CMD ["python3"]' "$python_tar" "$PYTHON_BASE_IMAGE" >/dev/null
        say "imported $PYTHON_BASE_IMAGE"
    fi
    if ! have_image "$AGENT_BASE_IMAGE"; then
        "$DOCKER" import --change "ENV $path" --change 'CMD ["sh"]' \
            "$agent_tar" "$AGENT_BASE_IMAGE" >/dev/null
        say "imported $AGENT_BASE_IMAGE"
    fi
else
    say "$PYTHON_BASE_IMAGE and $AGENT_BASE_IMAGE are already in the engine"
fi
if [ "$print" = 1 ]; then
    echo "--build-arg PYTHON_BASE=$PYTHON_BASE_IMAGE --build-arg AGENT_BASE=$AGENT_BASE_IMAGE"
fi
