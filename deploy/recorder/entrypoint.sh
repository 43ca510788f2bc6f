#!/bin/sh
# The recorder image's entrypoint: kernel headers and tracefs checked, then `shadowtest "$@"`.
# Kernel headers, first found: /lib/modules/$(uname -r)/build as it is; the host's, mounted at /host
# (/host/lib/modules and /host/usr/src, as deploy/recorder/daemonset.yaml mounts them: the host's build link
# usually points into its /usr/src); else the image's own Debian headers. bcc's tracepoint programs need
# only a matching-enough tree (docs/capture.md, "Running on a fleet").
set -eu
rel=$(uname -r)
mod=/lib/modules/$rel
host_tree() {   # host_tree LINK: the host's directory LINK names, seen from here under /host ("" if none)
    if [ -L "$1" ]; then
        t=$(readlink "$1")
        case "$t" in /*) [ -d "/host$t/include" ] && { echo "/host$t"; return; } ;; esac
    fi
    [ -d "$1/include" ] && echo "$1" || echo ""
}
if [ ! -e "$mod/build/include" ]; then
    build=$(host_tree "/host/lib/modules/$rel/build")
    source=$(host_tree "/host/lib/modules/$rel/source")
    if [ -z "$build" ]; then
        build=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n1)
        source=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -n1)
    fi
    if [ -n "$build" ] && mkdir -p "$mod" 2>/dev/null && ln -sfn "$build" "$mod/build" 2>/dev/null \
            && ln -sfn "${source:-$build}" "$mod/source" 2>/dev/null; then
        :
    else
        echo "shadowtest-entrypoint: no kernel headers at $mod/build and none to link there:" \
             "mount the host's /lib/modules and /usr/src under /host (the DaemonSet does)" >&2
    fi
fi
if [ ! -e /sys/kernel/tracing/events ] && [ ! -e /sys/kernel/debug/tracing/events ]; then
    echo "shadowtest-entrypoint: no tracefs: mount the host's /sys/kernel/tracing (or /sys/kernel/debug)" >&2
fi
exec shadowtest "$@"
