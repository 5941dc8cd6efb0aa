#!/usr/bin/env bash
# Run every test of nodeplan on a fresh machine: installs what the tests need (Debian packages,
# cargo-nextest if missing), builds or reuses the two kube-apiserver/etcd caches outside the clone
# (1.20.2 and the current release), then runs fmt, clippy, the whole test suite against 1.20, the
# Kubernetes test binaries again against the current release, and the Rancher conformance suite
# (tests/conformance, Go) against both (and once more with the May 2026 pkg/plan, which spells
# cancel "cancelled"), and last the Windows tests under Wine (tools/windows.sh). Arguments go to
# both `cargo nextest run`s. `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
# systemd-analyze (package systemd), unshare and mount (util-linux, mount) and curl are for
# tests/install.rs: the unit check, the read-only /usr/local in a private mount namespace, install.sh.
# nsenter and fsfreeze (util-linux) freeze the state disk of tests/remote_agent.rs (R31).
for cmd in openssl sh sleep mkfifo systemd-analyze unshare nsenter fsfreeze mount curl; do command -v "$cmd" >/dev/null || need+=("$cmd"); done
if [ ${#need[@]} -gt 0 ]; then
  echo "installing Debian packages for: ${need[*]}" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssl coreutils systemd util-linux mount curl >/dev/null
fi
# promtool and a real Prometheus server for tests/metrics.rs (Debian's `prometheus` package).
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  echo "installing Debian packages for: prometheus promtool" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
command -v cargo-nextest >/dev/null || cargo install --locked cargo-nextest
# Packaging tests (tests/packaging.rs): the tools that check the .deb and .rpm the way a
# distribution would, and what tools/package.sh builds them with.
pkgs=()
# mkfs.ext4 (e2fsprogs) makes the small filesystem that test freezes.
for pair in dpkg-deb:dpkg lintian:lintian rpm:rpm man:man-db objcopy:binutils systemd-analyze:systemd mkfs.ext4:e2fsprogs; do
  command -v "${pair%%:*}" >/dev/null || pkgs+=("${pair#*:}")
done
if [ ${#pkgs[@]} -gt 0 ]; then
  echo "installing Debian packages: ${pkgs[*]}" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${pkgs[@]}" >/dev/null
fi

# The real kube-apiserver, kubectl and etcd for remote-mode and custom-resource tests, in two
# versions, each cached outside the clone and rebuilt only when its recipe changes: 1.20.2 from
# Debian's source package (about 9 minutes once) and the current release from the Go module proxy
# (tools/k8s-current; about 22 minutes once). The whole suite runs against 1.20; the test binaries
# that start a control plane run a second time against the current version.
K8S_CACHE=${NODEPLAN_K8S_CACHE:-/var/tmp/nodeplan-k8s}
tools/build-kube-apiserver.sh "$K8S_CACHE" >&2
export NODEPLAN_K8S_BIN="$K8S_CACHE/bin"
K8S_CURRENT_BIN=$(tools/build-kube-apiserver-current.sh ${NODEPLAN_K8S_CURRENT_CACHE:+"$NODEPLAN_K8S_CURRENT_CACHE"})

cargo fmt --all -- --check
cargo clippy --all-targets --locked -- -D warnings
# The release binary and the .deb/.rpm, built once here for tests/packaging.rs to check (one
# release build, a few minutes; it also installs cargo-deb, cargo-generate-rpm, cargo-zigbuild
# and zig if missing).
tools/package.sh >&2
# Each run names the version it is for; a test checks the control plane is that one.
k8s_current=$(sed -n 's#^[[:space:]]*k8s.io/kubernetes \(v[^ ]*\).*#\1#p' tools/k8s-current/go.mod | sed -n 1p)
rc=0
echo "=== every test; the Kubernetes suites against kube-apiserver v1.20.2 ===" >&2
# tests/windows_agent.rs needs the Windows build: tools/windows.sh runs it, below.
NODEPLAN_K8S_EXPECT_VERSION=v1.20.2 cargo nextest run --locked --no-fail-fast -E 'not binary(windows_agent)' "$@" || rc=$?
# The test binaries that start a control plane (they include tests/k8s_support), again. Arguments
# that select none of their tests (a filter for another binary) leave this run empty: a warning.
k8s_tests=()
for t in tests/*.rs; do
  if grep -q '^mod k8s_support;' "$t" && [ "$t" != tests/windows_agent.rs ]; then k8s_tests+=(--test "$(basename "$t" .rs)"); fi
done
echo "=== the Kubernetes suites against kube-apiserver $k8s_current ===" >&2
NODEPLAN_K8S_BIN="$K8S_CURRENT_BIN" NODEPLAN_K8S_EXPECT_VERSION="$k8s_current" cargo nextest run --locked --no-fail-fast --no-tests=warn "${k8s_tests[@]}" "$@" || rc=$?


# The Rancher conformance suite (tests/conformance, a Go module): the debug binary nextest
# built, driven through Rancher's plan calls against the same kube-apiserver cache, every key it
# writes decoded with Rancher's pkg/plan types. Its modules come from the Go module proxy into the
# default module cache (outside the clone); go.sum pins them. It runs even when a Rust test
# failed, and NODEPLAN_CI (set by .ci/run) turns a missing binary or Go into a failure.
if ! command -v go >/dev/null && [ -x /usr/local/go/bin/go ]; then PATH="$PATH:/usr/local/go/bin"; fi
if command -v go >/dev/null; then
  (
    # nextest's build of every test target made target/debug/nodeplan; with arguments it may
    # have built none that needs it, so build it then.
    [ $# -eq 0 ] || cargo build --locked --bin nodeplan
    cd tests/conformance
    test -z "$(gofmt -l .)" || { echo "gofmt: $(gofmt -l .)" >&2; exit 1; }
    go vet .
    go vet -modfile=go.cancelled.mod -tags cancelled .
    crc=0
    for bin in "$NODEPLAN_K8S_BIN" "$K8S_CURRENT_BIN"; do
      echo "=== the Rancher conformance suite against $bin ===" >&2
      NODEPLAN_K8S_BIN="$bin" NODEPLAN_BIN="$PWD/../../target/debug/nodeplan" go test -count=1 -timeout 10m -v . || crc=$?
    done
    # Again with the May 2026 pkg/plan, which spells cancel "cancelled" (state and annotation).
    echo "=== the Rancher conformance suite, cancel spelt \"cancelled\", against $NODEPLAN_K8S_BIN ===" >&2
    NODEPLAN_BIN="$PWD/../../target/debug/nodeplan" go test -modfile=go.cancelled.mod -tags cancelled -count=1 -timeout 10m -v . || crc=$?
    exit "$crc"
  ) || rc=$?
elif [ -n "${NODEPLAN_CI:-}" ]; then
  echo "FAIL: NODEPLAN_CI is set and go is not installed: the Rancher conformance suite cannot run" >&2
  rc=1
else
  echo "*** SKIPPED the Rancher conformance suite (tests/conformance): go is not installed ***" >&2
fi

# The Windows build and its tests under Wine (docs/windows.md): its own toolchain (Debian's Rust,
# mingw-w64, Wine 8), installed on first use; the build goes to target/windows.
tools/windows.sh || rc=$?
exit "$rc"
