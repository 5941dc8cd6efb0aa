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
#       download it over https only (curl, or GNU wget), checked against
#       CATTLE_AGENT_BINARY_SHA256 (its SHA-256 in hex). The download runs as root: without a
#       checksum it is refused, unless CATTLE_AGENT_BINARY_UNCHECKED=true (then a warning says
#       so). A redirect to anything but https is refused (curl); GNU wget follows no redirect at
#       all, and BusyBox wget (which cannot refuse a redirect to http) is not used.
#
# OPTIONS are passed to `nodeplan install` as they are (`--root DIR`, `--force`, `--local`, …).
# The exit code is nodeplan install's (2 for a problem found here).
set -eu

fatal() {
    echo "install.sh: $*" >&2
    exit 2
}

# Refuse a file root would run that another user could change, as `nodeplan install --binary`
# does: it and every directory above it must be root's (or this user's), and not writable by
# group or others (a sticky directory, such as /tmp, is accepted on the way). $1 is a path with
# no link left in it (readlink -f).
changeable_by_others() {
    me=$(id -u)
    p=$1
    while :; do
        st=$(stat -c '%u %a' "$p" 2>/dev/null) || { echo "$p cannot be looked at"; return 0; }
        owner=${st% *}
        mode=${st#* }
        if [ "$owner" != 0 ] && [ "$owner" != "$me" ]; then
            echo "$p is owned by uid $owner"
            return 0
        fi
        if [ $((0$mode & 022)) -ne 0 ] && { [ "$p" = "$1" ] || [ $((0$mode & 01000)) -eq 0 ]; }; then
            echo "$p is writable by group or others (mode $mode)"
            return 0
        fi
        [ "$p" = / ] && return 1
        p=$(dirname "$p")
    done
}

if [ "${CATTLE_AGENT_BINARY_LOCAL:-false}" = "true" ]; then
    bin=${CATTLE_AGENT_BINARY_LOCAL_LOCATION:-}
    [ -n "$bin" ] || fatal "CATTLE_AGENT_BINARY_LOCAL is true but CATTLE_AGENT_BINARY_LOCAL_LOCATION is not set"
    [ -f "$bin" ] && [ -x "$bin" ] || fatal "$bin is not an executable file"
    # Checked, then run, by the path with its links resolved: no link can be swapped in between.
    real=$(readlink -f "$bin") || fatal "$bin: cannot resolve its path"
    if why=$(changeable_by_others "$real"); then
        fatal "CATTLE_AGENT_BINARY_LOCAL_LOCATION $bin: refused: $why, so another user could change what root runs"
    fi
    exec "$real" install --binary "$real" "$@"
fi

url=${CATTLE_AGENT_BINARY_URL:-}
[ -n "$url" ] || fatal "set CATTLE_AGENT_BINARY_URL (where to download nodeplan), or CATTLE_AGENT_BINARY_LOCAL=true with CATTLE_AGENT_BINARY_LOCAL_LOCATION"
# For messages: userinfo (a password) in the URL is shown as ***@.
shown=$(printf '%s\n' "$url" | sed 's#^\([A-Za-z][A-Za-z0-9+.-]*://\)[^/?#]*@#\1***@#')
case "$url" in
    https://*) ;;
    *) fatal "CATTLE_AGENT_BINARY_URL must be an https:// URL, not $shown" ;;
esac
sum=$(printf '%s' "${CATTLE_AGENT_BINARY_SHA256:-}" | tr 'A-F' 'a-f')
if [ -n "$sum" ]; then
    [ "${#sum}" -eq 64 ] && [ -z "$(printf '%s' "$sum" | tr -d '0-9a-f')" ] ||
        fatal "CATTLE_AGENT_BINARY_SHA256 is not a SHA-256 in hex (64 digits)"
elif [ "${CATTLE_AGENT_BINARY_UNCHECKED:-false}" = "true" ]; then
    echo "install.sh: WARNING: CATTLE_AGENT_BINARY_SHA256 is not set: $shown will run as root UNCHECKED (CATTLE_AGENT_BINARY_UNCHECKED=true)" >&2
else
    fatal "CATTLE_AGENT_BINARY_SHA256 is not set: refusing to run a download as root unchecked; set it to the binary's SHA-256 (sha256sum nodeplan), or CATTLE_AGENT_BINARY_UNCHECKED=true to run it anyway"
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
trap 'exit 130' INT TERM
if command -v curl >/dev/null 2>&1; then
    # https only, redirects included (a redirect to http fails).
    curl --proto '=https' --proto-redir '=https' -fsSL --retry 5 -o "$tmp/nodeplan" "$url" ||
        fatal "cannot download $shown (only https is followed, redirects included)"
elif command -v wget >/dev/null 2>&1; then
    # wget's --https-only holds in recursive mode only: no redirect is followed at all. BusyBox
    # wget has no --max-redirect, so it cannot refuse a redirect to http: it is not used.
    wget --help 2>&1 | grep -q -- '--max-redirect' ||
        fatal "this wget (BusyBox?) cannot refuse a redirect to http: install curl"
    wget --https-only --max-redirect=0 -q -O "$tmp/nodeplan" "$url" ||
        fatal "cannot download $shown (wget follows no redirect: give the final https:// URL, or install curl)"
else
    fatal "neither curl nor wget is installed"
fi
if [ -n "$sum" ]; then
    got=$(sha256sum "$tmp/nodeplan" | cut -d' ' -f1)
    [ "$got" = "$sum" ] || fatal "$shown has SHA-256 $got, not CATTLE_AGENT_BINARY_SHA256 ($sum)"
fi
chmod 0755 "$tmp/nodeplan"
# Not exec: the trap removes the download afterwards (nodeplan install has copied it).
rc=0
"$tmp/nodeplan" install --binary "$tmp/nodeplan" "$@" || rc=$?
exit "$rc"
