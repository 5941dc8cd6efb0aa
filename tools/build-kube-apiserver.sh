#!/usr/bin/env bash
# Build a genuine kube-apiserver and kubectl (v1.20.2) from Debian bookworm's `kubernetes` source
# package with Debian's Go 1.19, and unpack Debian's etcd 3.4, into a cache directory OUTSIDE the
# clone.
#
# Usage: tools/build-kube-apiserver.sh [CACHE_DIR]   (default /var/tmp/nodeplan-k8s)
# Prints the bin directory on the last line. Needs only apt (root, the Debian registry), make,
# openssl, flock. Installs nothing system-wide.
#
# The cache, when complete:
#   CACHE_DIR/bin/{kube-apiserver,kubectl,etcd,etcdctl}
#   CACHE_DIR/recipe     the RECIPE below that built it
#   CACHE_DIR/versions   what went into it (package versions, Go, build time), for humans
# A run whose cache has all four binaries and `recipe` equal to RECIPE exits at once ("cached").
# Any other cache (older recipe, missing binary, interrupted build) is rebuilt whole; a cache
# without `recipe` is recipe 1. Bump RECIPE whenever the binaries this script makes change, so
# every existing cache (CI's, developers') rebuilds once and is then reused. tests/k8s_support
# reads the stamp too: custom-resource tests need recipe 2 or later.
#
# Recipe history:
#   1  kube-apiserver, etcd, etcdctl.
#   2  Kubernetes' vendored github.com/modern-go/reflect2 (1.0.1) and github.com/json-iterator/go
#      are replaced by Debian's golang-github-modern-go-reflect2-dev (1.0.2) and
#      golang-github-json-iterator-go-dev (1.1.12): reflect2 1.0.1's unsafe map iteration faults
#      under Go >= 1.18, so a recipe-1 apiserver dies with SIGSEGV (aeshashbody in
#      runtime.mapiternext, from json-iterator) on the first create of a custom resource. Also
#      builds kubectl from the same tree.
#
# Safe while tests use the cache: everything is built in CACHE_DIR.new (a sibling, same file
# system) and only then swapped in, by an atomic exchange of the two directories (renameat2
# RENAME_EXCHANGE), so CACHE_DIR/bin always holds a complete set of binaries; processes already
# running from the old cache keep their (unlinked) files. (Where the file system cannot exchange,
# two renames leave a moment without CACHE_DIR.) Two runs at once serialise on CACHE_DIR.lock; the
# second then finds the first's cache. A build that fails or is interrupted leaves the old cache
# as it was; the next run starts CACHE_DIR.new afresh.
set -euo pipefail
RECIPE=2
OUT=$(realpath -m "${1:-/var/tmp/nodeplan-k8s}")
NEW="$OUT.new"
K8S_DEB_VERSION=1.20.5+really1.20.2-1.1+deb12u1
BINS=(kube-apiserver kubectl etcd etcdctl)

cached() {
  [ "$(cat "$OUT/recipe" 2>/dev/null)" = "$RECIPE" ] || return 1
  local b
  for b in "${BINS[@]}"; do [ -x "$OUT/bin/$b" ] || return 1; done
}
if cached; then echo "kube-apiserver cache: $OUT/bin (cached, recipe $RECIPE)"; exit 0; fi

mkdir -p "$(dirname "$OUT")"
exec 9>"$OUT.lock"
if ! flock -n 9; then
  echo "another build of $OUT is running; waiting for it" >&2
  flock 9
  if cached; then echo "kube-apiserver cache: $OUT/bin (built by the other run, recipe $RECIPE)"; exit 0; fi
fi
# Only ever replace a directory this script made.
if [ -e "$OUT" ] && [ -n "$(ls -A "$OUT")" ] && ! [ -e "$OUT/bin" ] && ! [ -e "$OUT/recipe" ]; then
  echo "$OUT exists and is not a kube-apiserver cache; name another directory" >&2
  exit 1
fi
if [ -e "$OUT/recipe" ] || [ -e "$OUT/bin" ]; then
  echo "kube-apiserver cache $OUT is stale (recipe $(cat "$OUT/recipe" 2>/dev/null || echo 1), want $RECIPE, or a binary is missing)" >&2
fi
echo "building kube-apiserver and kubectl into $NEW, then swapping it in as $OUT (about 9 minutes on 2 cores, once)" >&2
rm -rf "$NEW"
mkdir -p "$NEW"/{apt/parts,apt/lists/partial,apt/cache/archives/partial,debs,root,bin,src}
# The machine's own Debian mirror plus deb-src, in a private apt state directory.
if [ -f /etc/apt/sources.list.d/debian.sources ]; then
  sed 's/^Types: deb$/Types: deb deb-src/' /etc/apt/sources.list.d/debian.sources > "$NEW/apt/parts/debian.sources"
else
  sed -n 's/^deb \(.*\)$/deb \1\ndeb-src \1/p' /etc/apt/sources.list > "$NEW/apt/parts/debian.list"
fi
APT=(-o Dir::Etc::sourcelist=/dev/null -o Dir::Etc::sourceparts="$NEW/apt/parts"
     -o Dir::State::Lists="$NEW/apt/lists" -o Dir::Cache="$NEW/apt/cache" -o APT::Sandbox::User=root)
apt-get "${APT[@]}" update -qq
(cd "$NEW/debs" && apt-get "${APT[@]}" download -qq golang-1.19-go golang-1.19-src etcd-server etcd-client \
   rsync libpopt0 golang-github-modern-go-reflect2-dev golang-github-json-iterator-go-dev)
for d in "$NEW"/debs/*.deb; do dpkg -x "$d" "$NEW/root"; done
(cd "$NEW/src" && { apt-get "${APT[@]}" source --download-only -qq "kubernetes=$K8S_DEB_VERSION" \
   || apt-get "${APT[@]}" source --download-only -qq kubernetes; } && tar xzf kubernetes_*.orig.tar.gz)
SRC=$(ls -d "$NEW"/src/kubernetes-*/ | sed -n 1p); SRC=${SRC%/}

# Replace the vendored reflect2 1.0.1 and json-iterator 1.1.10 with Debian's 1.0.2 and 1.1.12 (same
# API; see recipe 2 above). GOPATH mode below reads vendor/ directly, so modules.txt is irrelevant.
for m in github.com/modern-go/reflect2 github.com/json-iterator/go; do
  [ -d "$NEW/root/usr/share/gocode/src/$m" ] || { echo "Debian's package lacks usr/share/gocode/src/$m" >&2; exit 1; }
  rm -rf "${SRC:?}/vendor/$m"
  cp -r "$NEW/root/usr/share/gocode/src/$m" "$SRC/vendor/$m"
  find "$SRC/vendor/$m" -name '*_test.go' -delete
done

export GOROOT="$NEW/root/usr/lib/go-1.19" GOPROXY=off GOFLAGS= CGO_ENABLED=0
export PATH="$NEW/root/usr/bin:$GOROOT/bin:$PATH" LD_LIBRARY_PATH="$NEW/root/usr/lib/x86_64-linux-gnu"
# The release tarball lacks pkg/generated/openapi; generate it with Kubernetes' own make target.
(cd "$SRC" && make gen_openapi)
# GOPATH mode against vendor/, as Kubernetes 1.20's hack/ scripts build.
export GOPATH="$NEW/gopath" GOCACHE="$NEW/gocache" GO111MODULE=off
mkdir -p "$GOPATH/src/k8s.io" && ln -sfn "$SRC" "$GOPATH/src/k8s.io/kubernetes"
V=k8s.io/kubernetes/vendor/k8s.io
LD="-s -w"
for p in component-base/version client-go/pkg/version; do
  LD="$LD -X $V/$p.gitVersion=v1.20.2 -X $V/$p.gitMajor=1 -X $V/$p.gitMinor=20 -X $V/$p.gitTreeState=clean"
done
T0=$SECONDS
cd "$GOPATH/src/k8s.io/kubernetes"
go build -ldflags "$LD" -o "$NEW/bin/kube-apiserver" ./cmd/kube-apiserver
go build -ldflags "$LD" -o "$NEW/bin/kubectl" ./cmd/kubectl
# The swap helper: renameat2(RENAME_EXCHANGE) from the vendored golang.org/x/sys/unix.
mkdir -p cmd/nodeplan-exchange
cat > cmd/nodeplan-exchange/main.go <<'EOF'
// Atomically exchange two paths (renameat2 RENAME_EXCHANGE).
package main

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

func main() {
	if err := unix.Renameat2(unix.AT_FDCWD, os.Args[1], unix.AT_FDCWD, os.Args[2], unix.RENAME_EXCHANGE); err != nil {
		fmt.Fprintf(os.Stderr, "exchange %s %s: %v\n", os.Args[1], os.Args[2], err)
		os.Exit(1)
	}
}
EOF
go build -o "$NEW/exchange" ./cmd/nodeplan-exchange
cd /
BUILD_S=$((SECONDS - T0))
cp "$NEW/root/usr/bin/etcd" "$NEW/root/usr/bin/etcdctl" "$NEW/bin/"

pkgver() { dpkg-deb -f "$(ls "$NEW"/debs/"$1"_*.deb)" Version; }
{
  echo "recipe $RECIPE, built $(date -u +%Y-%m-%dT%H:%M:%SZ) in ${BUILD_S}s of go build"
  echo "kubernetes source $(ls "$NEW"/src/kubernetes_*.dsc | sed 's/.*kubernetes_\(.*\)\.dsc/\1/')"
  "$GOROOT/bin/go" version
  for p in golang-github-modern-go-reflect2-dev golang-github-json-iterator-go-dev etcd-server; do
    echo "$p $(pkgver "$p")"
  done
  "$NEW/bin/kube-apiserver" --version
  "$NEW/bin/kubectl" version --client --short 2>/dev/null || "$NEW/bin/kubectl" version --client
  "$NEW/bin/etcd" --version | sed -n 1p
} > "$NEW/versions"
cat "$NEW/versions" >&2
echo "$RECIPE" > "$NEW/recipe"
# Keep only the binaries and the stamps: the Go cache, sources and toolchain are 3 GB.
mv "$NEW/exchange" "$NEW.exchange"
rm -rf "$NEW/gopath" "$NEW/gocache" "$NEW/src" "$NEW/debs" "$NEW/apt" "$NEW/root"

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
echo "kube-apiserver cache: $OUT/bin (recipe $RECIPE, built in ${BUILD_S}s)"
