#!/usr/bin/env bash
# Build nodeplan for Windows (x86_64-pc-windows-gnu) and run its Windows tests under Wine; called
# by tools/test.sh. Installs what it needs on a fresh Debian machine:
#   - Debian's Rust (rustc-web, cargo-web, rust-web-src: rustup's toolchains have no Windows
#     standard library here, so it is built from source with -Zbuild-std, which needs
#     RUSTC_BOOTSTRAP=1 on a stable compiler, and /usr/bin first in PATH so that cargo, rustc
#     and rustdoc are all Debian's);
#   - the mingw-w64 linker and Wine 8 (wine64);
#   - a Wine prefix outside the clone (NODEPLAN_WINE_PREFIX, default /var/tmp/nodeplan-wine) with a
#     one-function bcryptprimitives.dll (tools/windows/): Wine 8 lacks ProcessPrng, which Rust's
#     standard library imports.
# Arguments go to the Windows `cargo test` (after the targets). The build goes to target/windows,
# apart from the Linux build's caches.
set -euo pipefail
cd "$(dirname "$0")/.."
# The Linux toolchain (rustup's), for the end-to-end test at the end.
linux_path=$PATH

pkgs=()
for p in rustc-web cargo-web rust-web-src gcc-mingw-w64-x86-64 wine64 wine; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || pkgs+=("$p")
done
if [ ${#pkgs[@]} -gt 0 ]; then
  echo "installing Debian packages for the Windows build: ${pkgs[*]}" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
fi

export WINEPREFIX=${NODEPLAN_WINE_PREFIX:-/var/tmp/nodeplan-wine}
export WINEDEBUG=-all
# No display here: no Mono or Gecko installer prompts; the stub bcryptprimitives.dll over Wine's.
export WINEDLLOVERRIDES="mscoree,mshtml=;bcryptprimitives=n"
export DISPLAY=
if [ ! -f "$WINEPREFIX/system.reg" ]; then
  echo "making the Wine prefix $WINEPREFIX" >&2
  mkdir -p "$WINEPREFIX"
  wineboot -i >/dev/null 2>&1
  wineserver -w
fi
dll="$WINEPREFIX/drive_c/windows/system32/bcryptprimitives.dll"
if [ ! -f "$dll.nodeplan" ] || ! cmp -s tools/windows/bcryptprimitives.c "$dll.nodeplan"; then
  x86_64-w64-mingw32-gcc -O2 -shared -o "$dll" tools/windows/bcryptprimitives.c tools/windows/bcryptprimitives.def -ladvapi32
  cp tools/windows/bcryptprimitives.c "$dll.nodeplan"
fi

export PATH="/usr/bin:$PATH"
export RUSTC_BOOTSTRAP=1
export CARGO_TARGET_DIR="$PWD/target/windows"
export CARGO_TARGET_X86_64_PC_WINDOWS_GNU_LINKER=x86_64-w64-mingw32-gcc
export CARGO_TARGET_X86_64_PC_WINDOWS_GNU_RUNNER=wine
echo "=== the Windows tests under Wine ($(wine --version), $(rustc --version)) ===" >&2
# Bounded: a test stuck in Wine must not hold CI; whatever Wine still runs is ended after.
status=0
timeout 900 cargo test --locked -Zbuild-std --target x86_64-pc-windows-gnu --lib --bins --test windows_process "$@" || status=$?
# The Windows agent end to end (tests/windows_agent.rs, a Linux test built by the Linux toolchain):
# the nodeplan.exe just built, under Wine, in remote mode against the Linux kube-apiserver.
win_bin="$CARGO_TARGET_DIR/x86_64-pc-windows-gnu/debug"
echo "=== the Windows agent under Wine against kube-apiserver (tests/windows_agent.rs) ===" >&2
(
  export PATH="$linux_path"
  unset RUSTC_BOOTSTRAP CARGO_TARGET_DIR CARGO_TARGET_X86_64_PC_WINDOWS_GNU_LINKER CARGO_TARGET_X86_64_PC_WINDOWS_GNU_RUNNER
  export NODEPLAN_WINDOWS_EXE="$win_bin/nodeplan.exe" NODEPLAN_WINDOWS_HELPER="$win_bin/nodeplan-test-helper.exe"
  timeout 900 cargo test --locked --test windows_agent
) || status=$?
wineserver -k 2>/dev/null || true
exit "$status"
