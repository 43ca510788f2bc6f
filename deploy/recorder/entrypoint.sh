#!/bin/sh
# The recorder image's entrypoint: kernel headers and tracefs checked, then `shadowtest "$@"`.
set -eu
rel=$(uname -r)
mod=/lib/modules/$rel
if [ ! -e "$mod/build/include" ]; then
    # The host's headers are not mounted (or it has none): use the image's Debian headers. bcc's
    # tracepoint programs need only a matching-enough tree (docs/capture.md, "Running on a fleet").
    hdr=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n1)
    common=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -n1)
    if [ -n "$hdr" ] && mkdir -p "$mod" 2>/dev/null && ln -sfn "$hdr" "$mod/build" 2>/dev/null \
            && ln -sfn "${common:-$hdr}" "$mod/source" 2>/dev/null; then
        :
    else
        echo "shadowtest-entrypoint: no kernel headers at $mod/build and $mod cannot be written:" \
             "mount the host's /lib/modules and /usr/src read-only, or leave /lib/modules unmounted" >&2
    fi
fi
if [ ! -e /sys/kernel/tracing/events ] && [ ! -e /sys/kernel/debug/tracing/events ]; then
    echo "shadowtest-entrypoint: no tracefs: mount the host's /sys/kernel/tracing (or /sys/kernel/debug)" >&2
fi
exec shadowtest "$@"
