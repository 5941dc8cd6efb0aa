#!/usr/bin/env bash
# Build a current kube-apiserver and kubectl, and etcd, from the Go module proxy with the installed
# Go, into a cache directory OUTSIDE the clone. The sibling of tools/build-kube-apiserver.sh (which
# builds 1.20.2 from Debian's source package); the tests run against both.
#
# Usage: tools/build-kube-apiserver-current.sh [CACHE_DIR]
#   default CACHE_DIR: /var/tmp/nodeplan-k8s-<version>, <version> being the k8s.io/kubernetes
#   version tools/k8s-current/go.mod requires (e.g. /var/tmp/nodeplan-k8s-1.37.2).
# Prints the bin directory, and only it, on stdout (messages go to stderr):
#   NODEPLAN_K8S_BIN=$(tools/build-kube-apiserver-current.sh) Needs go (the version tools/k8s-current/go.mod names
# or newer; no toolchain download), the Go module proxy, flock, sha256sum.
#
# What it builds: tools/k8s-current is a Go main module that requires k8s.io/kubernetes (its
# staging modules pinned by replace lines) and go.etcd.io/etcd/server/v3. kube-apiserver and
# kubectl are upstream's own main packages (`tool` lines of go.mod), so they take upstream's flags;
# etcd is tools/k8s-current/etcd, a three-line main around etcdmain.Main (etcd's own command line).
# Built with -trimpath, CGO_ENABLED=0 and the version stamps upstream's hack/lib/version.sh sets,
# against go.sum (-mod=readonly); the module download and build caches are private to the build
# (CACHE_DIR.new) and deleted after it, so nothing is read from or written to the clone but
# tools/k8s-current itself, read-only.
#
# The cache, when complete:
#   CACHE_DIR/bin/{kube-apiserver,kubectl,etcd}
#   CACHE_DIR/recipe     "current-<RECIPE> <sha256 of tools/k8s-current's go.mod, go.sum, *.go>"
#   CACHE_DIR/versions   what went into it (versions, Go, build time), for humans
# A run whose cache has the three binaries and the same `recipe` exits at once ("cached"). So
# changing go.mod or go.sum (a new Kubernetes or etcd) rebuilds once; bump RECIPE when this script
# changes what it makes.
#
# Recipe history:
#   1  kube-apiserver, kubectl, etcd.
#
# Safe while tests use the cache, as tools/build-kube-apiserver.sh: built in CACHE_DIR.new, then
# swapped in by an atomic exchange (renameat2 RENAME_EXCHANGE; tools/k8s-current/exchange); two
# runs at once serialise on CACHE_DIR.lock; a failed or interrupted build leaves the old cache.
# The whole script is one function, read before it runs: editing or checking out this file during
# a build does not change the build under way.
set -euo pipefail
main() {
  RECIPE=1
  HERE=$(cd "$(dirname "$0")" && pwd)
  MOD="$HERE/k8s-current"
  BINS=(kube-apiserver kubectl etcd)

  command -v go >/dev/null || { echo "go is not installed; the current Kubernetes needs $(sed -n 's/^go //p' "$MOD/go.mod") or newer" >&2; exit 1; }
  # Only the module proxy and go.sum, never a toolchain download or a change of go.mod/go.sum.
  export GOTOOLCHAIN=local GOFLAGS="-trimpath -mod=readonly -buildvcs=false" CGO_ENABLED=0 GOWORK=off
  # The versions go.mod requires (read offline: a cached run touches no network).
  required() { sed -n "s#^[[:space:]]*$1 \(v[^ ]*\).*#\1#p" "$MOD/go.mod" | sed -n 1p; }
  K8S_VERSION=$(required k8s.io/kubernetes)
  ETCD_VERSION=$(required go.etcd.io/etcd/server/v3)
  [ -n "$K8S_VERSION" ] && [ -n "$ETCD_VERSION" ] || { echo "$MOD/go.mod names no k8s.io/kubernetes or etcd version" >&2; exit 1; }
  OUT=$(realpath -m "${1:-/var/tmp/nodeplan-k8s-${K8S_VERSION#v}}")
  NEW="$OUT.new"
  STAMP="current-$RECIPE $(cd "$MOD" && cat go.mod go.sum etcd/main.go exchange/main.go | sha256sum | cut -c1-64)"

  cached() {
    [ "$(cat "$OUT/recipe" 2>/dev/null)" = "$STAMP" ] || return 1
    local b
    for b in "${BINS[@]}"; do [ -x "$OUT/bin/$b" ] || return 1; done
  }
  done_() { echo "kube-apiserver $K8S_VERSION cache: $OUT/bin ($1)" >&2; echo "$OUT/bin"; exit 0; }
  if cached; then done_ "cached, recipe $STAMP"; fi

  mkdir -p "$(dirname "$OUT")"
  exec 9>"$OUT.lock"
  if ! flock -n 9; then
    echo "another build of $OUT is running; waiting for it" >&2
    flock 9
    if cached; then done_ "built by the other run"; fi
  fi
  # Only ever replace a directory this script made.
  if [ -e "$OUT" ] && [ -n "$(ls -A "$OUT")" ] && ! [ -e "$OUT/bin" ] && ! [ -e "$OUT/recipe" ]; then
    echo "$OUT exists and is not a kube-apiserver cache; name another directory" >&2
    exit 1
  fi
  if [ -e "$OUT/recipe" ] || [ -e "$OUT/bin" ]; then
    echo "kube-apiserver cache $OUT is stale (recipe \"$(cat "$OUT/recipe" 2>/dev/null)\", want \"$STAMP\", or a binary is missing)" >&2
  fi
  echo "building kube-apiserver and kubectl $K8S_VERSION and etcd $ETCD_VERSION into $NEW, then swapping it in as $OUT (about 22 minutes once on a busy 2-core machine; 13 CPU-minutes)" >&2
  if [ -d "$NEW/gomod" ]; then GOMODCACHE="$NEW/gomod" go clean -modcache; fi
  rm -rf "$NEW"
  mkdir -p "$NEW/bin"
  export GOMODCACHE="$NEW/gomod" GOCACHE="$NEW/gocache"

  LD="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
    LD="$LD -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
  done
  T0=$SECONDS
  go -C "$MOD" mod download >&2
  DOWNLOAD_S=$((SECONDS - T0))
  go -C "$MOD" build -ldflags "$LD" -o "$NEW/bin/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver
  go -C "$MOD" build -ldflags "$LD" -o "$NEW/bin/kubectl" k8s.io/kubernetes/cmd/kubectl
  go -C "$MOD" build -ldflags "-s -w" -o "$NEW/bin/etcd" ./etcd
  go -C "$MOD" build -ldflags "-s -w" -o "$NEW.exchange" ./exchange
  BUILD_S=$((SECONDS - T0))

  {
    echo "recipe $STAMP, built $(date -u +%Y-%m-%dT%H:%M:%SZ) in ${BUILD_S}s (${DOWNLOAD_S}s of it module download)"
    echo "k8s.io/kubernetes $K8S_VERSION, go.etcd.io/etcd/server/v3 $ETCD_VERSION (tools/k8s-current/go.mod)"
    go version
    "$NEW/bin/kube-apiserver" --version
    "$NEW/bin/kubectl" version --client
    "$NEW/bin/etcd" --version | sed -n 1p
  } > "$NEW/versions"
  cat "$NEW/versions" >&2
  grep -qx "Kubernetes $K8S_VERSION" "$NEW/versions" || { echo "kube-apiserver does not say it is $K8S_VERSION" >&2; exit 1; }
  echo "$STAMP" > "$NEW/recipe"
  # Keep only the binaries and the stamps: the module and build caches are gigabytes.
  go clean -modcache
  rm -rf "$NEW/gomod" "$NEW/gocache"

  # Swap in. After the exchange, $NEW holds the old cache.
  if [ -e "$OUT" ]; then
    if ! "$NEW.exchange" "$NEW" "$OUT"; then
      # A file system without RENAME_EXCHANGE: two renames, a moment without $OUT.
      echo "no atomic exchange here; replacing $OUT with two renames" >&2
      rm -rf "$OUT.old" && mv -T "$OUT" "$OUT.old" && mv -T "$NEW" "$OUT" && mv -T "$OUT.old" "$NEW"
    fi
    rm -rf "$NEW"
  else
    mv -T "$NEW" "$OUT"
  fi
  rm -f "$NEW.exchange"
  cached || { echo "the swapped-in cache $OUT is incomplete" >&2; exit 1; }
  done_ "built in ${BUILD_S}s"
}

main "$@"
