#!/usr/bin/env bash
# Builds the release binary and the packages people ship, into target/package/:
#   nodeplan                    the stripped binary (what both packages install as /usr/bin/nodeplan)
#   nodeplan.debug              its debug info (line tables, symbols), found through .gnu_debuglink
#                               when kept beside the binary, or through the build id under
#                               /usr/lib/debug/.build-id/
#   nodeplan_VERSION-1_ARCH.deb (cargo-deb) and nodeplan-VERSION-1.ARCH.rpm (cargo-generate-rpm)
# The completions, the man page and the Debian changelog are generated here from the built binary
# (never written by hand) into target/package/stage, which Cargo.toml's package metadata names.
# Installs cargo-deb, cargo-generate-rpm and cargo-zigbuild with `cargo install --locked`, and zig
# (the ziglang package) with pip, when they are missing. Needs objcopy (binutils), gzip, python3.
set -euo pipefail
cd "$(dirname "$0")/.."

out=target/package
stage=$out/stage
command -v cargo-deb >/dev/null || cargo install --locked cargo-deb
command -v cargo-generate-rpm >/dev/null || cargo install --locked cargo-generate-rpm

# The oldest glibc the binary runs on. Linked on this machine's glibc (2.36 on Debian 12) it would
# need 2.34, which shuts out RHEL 8 (2.28) and SLES 15 (2.31); cargo-zigbuild links against zig's
# stubs of the glibc named here instead. zig comes from PyPI (ziglang), cargo-zigbuild from
# crates.io.
glibc=2.28
command -v cargo-zigbuild >/dev/null || cargo install --locked cargo-zigbuild
python3 -m ziglang version >/dev/null 2>&1 || python3 -m pip install --quiet ziglang
host=$(rustc -vV | sed -n 's/^host: //p')
# zig's linker writes no build id unless asked; debuggers and debuginfod find nodeplan.debug by it.
# The dist profile (Cargo.toml): release plus whole-program LTO.
cargo-zigbuild rustc --profile dist --locked --bin nodeplan --target "$host.$glibc" -- -C link-arg=-Wl,--build-id=sha1
built=${CARGO_TARGET_DIR:-target}/$host/dist/nodeplan

rm -rf "$out"
mkdir -p "$stage/completions"

# Debug info off into nodeplan.debug (compressed), then a stripped copy that names it. The CRC in
# .gnu_debuglink ties the binary to exactly this debug file.
objcopy --only-keep-debug --compress-debug-sections=zlib "$built" "$out/nodeplan.debug"
chmod 644 "$out/nodeplan.debug"
objcopy --strip-all --remove-section=.comment --add-gnu-debuglink="$out/nodeplan.debug" "$built" "$out/nodeplan"
cp "$out/nodeplan" "$stage/nodeplan"

# Generated from the binary that ships, so they always match its commands and options.
bin=$stage/nodeplan
"$bin" completions bash >"$stage/completions/nodeplan"
"$bin" completions zsh >"$stage/completions/_nodeplan"
"$bin" completions fish >"$stage/completions/nodeplan.fish"
"$bin" man | gzip -9n >"$stage/nodeplan.1.gz"

# A Debian changelog entry for this build: the version, the commit and that commit's date (as
# `nodeplan --version` prints them), so the same commit makes the same package.
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | sed -n 1p)
read -r _ _ _ commit date <<<"$("$bin" --version | tr -d '(),')"
when=$(date -u -R -d "${date/unknown/@0}" 2>/dev/null || date -u -R -d @0)
cat >"$stage/changelog" <<CHANGELOG
nodeplan ($version-1) unstable; urgency=medium

  * Release $version, built from commit $commit.

 -- nodeplan maintainers <maintainers@nodeplan.invalid>  $when
CHANGELOG

# Timestamps inside the packages: the commit's date, not the build's.
SOURCE_DATE_EPOCH=$(date -u +%s -d "$when")
export SOURCE_DATE_EPOCH
cargo deb --no-build --no-strip --output "$out/"
# Requires from the binary's shared libraries (ldd), the same on every build machine.
cargo generate-rpm --auto-req builtin --output "$out/"

ls -l "$out"
