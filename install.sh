#!/bin/sh
# nodeplan's installer for `curl -sfL …/install.sh | sh -s -- [OPTIONS]`, in place of
# system-agent's install.sh. It only finds the binary and hands over: everything else
# (connection info from Rancher, config, unit, enabling) is `nodeplan install`, which reads the
# same CATTLE_* variables system-agent's installer reads (see `nodeplan install --help`).
#
# The binary:
#   CATTLE_AGENT_BINARY_LOCAL=true and CATTLE_AGENT_BINARY_LOCAL_LOCATION=/path/to/nodeplan
#       use that file;
#   otherwise CATTLE_AGENT_BINARY_URL=https://…/nodeplan
#       download it (curl or wget), checked against CATTLE_AGENT_BINARY_SHA256 when set.
#
# OPTIONS are passed to `nodeplan install` as they are (`--root DIR`, `--force`, `--local`, …).
# The exit code is nodeplan install's (2 for a problem found here).
set -eu

fatal() {
    echo "install.sh: $*" >&2
    exit 2
}

if [ "${CATTLE_AGENT_BINARY_LOCAL:-false}" = "true" ]; then
    bin=${CATTLE_AGENT_BINARY_LOCAL_LOCATION:-}
    [ -n "$bin" ] || fatal "CATTLE_AGENT_BINARY_LOCAL is true but CATTLE_AGENT_BINARY_LOCAL_LOCATION is not set"
    [ -f "$bin" ] && [ -x "$bin" ] || fatal "$bin is not an executable file"
    exec "$bin" install --binary "$bin" "$@"
fi

url=${CATTLE_AGENT_BINARY_URL:-}
[ -n "$url" ] || fatal "set CATTLE_AGENT_BINARY_URL (where to download nodeplan), or CATTLE_AGENT_BINARY_LOCAL=true with CATTLE_AGENT_BINARY_LOCAL_LOCATION"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
trap 'exit 130' INT TERM
if command -v curl >/dev/null 2>&1; then
    curl -fsSL --retry 5 -o "$tmp/nodeplan" "$url" || fatal "cannot download $url"
elif command -v wget >/dev/null 2>&1; then
    wget -q -O "$tmp/nodeplan" "$url" || fatal "cannot download $url"
else
    fatal "neither curl nor wget is installed"
fi
if [ -n "${CATTLE_AGENT_BINARY_SHA256:-}" ]; then
    got=$(sha256sum "$tmp/nodeplan" | cut -d' ' -f1)
    [ "$got" = "$CATTLE_AGENT_BINARY_SHA256" ] || fatal "$url has SHA-256 $got, not CATTLE_AGENT_BINARY_SHA256 ($CATTLE_AGENT_BINARY_SHA256)"
fi
chmod 0755 "$tmp/nodeplan"
# Not exec: the trap removes the download afterwards (nodeplan install has copied it).
rc=0
"$tmp/nodeplan" install --binary "$tmp/nodeplan" "$@" || rc=$?
exit "$rc"
