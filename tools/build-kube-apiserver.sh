#!/usr/bin/env bash
# Build a genuine kube-apiserver (v1.20.2) from Debian bookworm's `kubernetes` source package with
# Debian's Go 1.19, and unpack Debian's etcd 3.4, into a cache directory OUTSIDE the clone.
# Usage: tools/build-kube-apiserver.sh [CACHE_DIR]   (default /var/tmp/nodeplan-k8s)
# Prints the bin directory on the last line. A second run with a complete cache exits at once.
# Needs only apt (root, the Debian registry), make, openssl. Installs nothing system-wide.
set -euo pipefail
OUT=$(realpath -m "${1:-/var/tmp/nodeplan-k8s}")
K8S_DEB_VERSION=1.20.5+really1.20.2-1.1+deb12u1
if [ -x "$OUT/bin/kube-apiserver" ] && [ -x "$OUT/bin/etcd" ]; then
  echo "kube-apiserver cache: $OUT/bin (cached)"; exit 0
fi
echo "building kube-apiserver into $OUT (about 5 minutes, once)" >&2
mkdir -p "$OUT"/{apt/parts,apt/lists/partial,apt/cache/archives/partial,debs,root,bin,src}
# The machine's own Debian mirror plus deb-src, in a private apt state directory.
if [ -f /etc/apt/sources.list.d/debian.sources ]; then
  sed 's/^Types: deb$/Types: deb deb-src/' /etc/apt/sources.list.d/debian.sources > "$OUT/apt/parts/debian.sources"
else
  sed -n 's/^deb \(.*\)$/deb \1\ndeb-src \1/p' /etc/apt/sources.list > "$OUT/apt/parts/debian.list"
fi
APT=(-o Dir::Etc::sourcelist=/dev/null -o Dir::Etc::sourceparts="$OUT/apt/parts"
     -o Dir::State::Lists="$OUT/apt/lists" -o Dir::Cache="$OUT/apt/cache" -o APT::Sandbox::User=root)
apt-get "${APT[@]}" update -qq
(cd "$OUT/debs" && apt-get "${APT[@]}" download -qq golang-1.19-go golang-1.19-src etcd-server etcd-client rsync libpopt0)
for d in "$OUT"/debs/*.deb; do dpkg -x "$d" "$OUT/root"; done
rm -rf "$OUT/src"/kubernetes-*
(cd "$OUT/src" && { apt-get "${APT[@]}" source --download-only -qq "kubernetes=$K8S_DEB_VERSION" \
   || apt-get "${APT[@]}" source --download-only -qq kubernetes; } && tar xzf kubernetes_*.orig.tar.gz)
SRC=$(ls -d "$OUT"/src/kubernetes-*/ | head -1); SRC=${SRC%/}
export GOROOT="$OUT/root/usr/lib/go-1.19" GOPROXY=off GOFLAGS= CGO_ENABLED=0
export PATH="$OUT/root/usr/bin:$GOROOT/bin:$PATH" LD_LIBRARY_PATH="$OUT/root/usr/lib/x86_64-linux-gnu"
# The release tarball lacks pkg/generated/openapi; generate it with Kubernetes' own make target.
(cd "$SRC" && make gen_openapi)
# GOPATH mode against vendor/, as Kubernetes 1.20's hack/ scripts build.
export GOPATH="$OUT/gopath" GOCACHE="$OUT/gocache" GO111MODULE=off
mkdir -p "$GOPATH/src/k8s.io" && ln -sfn "$SRC" "$GOPATH/src/k8s.io/kubernetes"
V=k8s.io/kubernetes/vendor/k8s.io
LD="-s -w"
for p in component-base/version client-go/pkg/version; do
  LD="$LD -X $V/$p.gitVersion=v1.20.2 -X $V/$p.gitMajor=1 -X $V/$p.gitMinor=20 -X $V/$p.gitTreeState=clean"
done
(cd "$GOPATH/src/k8s.io/kubernetes" && go build -ldflags "$LD" -o "$OUT/bin/kube-apiserver.tmp" ./cmd/kube-apiserver)
cp "$OUT/root/usr/bin/etcd" "$OUT/root/usr/bin/etcdctl" "$OUT/bin/"
mv "$OUT/bin/kube-apiserver.tmp" "$OUT/bin/kube-apiserver"
# Keep only the binaries: the Go cache and sources are 2+ GB.
rm -rf "$OUT/gopath" "$OUT/gocache" "$OUT/src" "$OUT/debs" "$OUT/apt/cache"
"$OUT/bin/kube-apiserver" --version >&2
echo "kube-apiserver cache: $OUT/bin"
