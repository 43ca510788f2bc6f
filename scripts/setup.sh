#!/usr/bin/env bash
# Idempotent set-up for `make test` / `make demo`: system packages, kernel headers for bcc,
# tracefs, and the virtual environment at .venv. A second run with nothing changed takes seconds.
# Where a step cannot be done (not root, no apt) it says what is missing and what is lost, and goes on.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
SYS_PKGS="python3-bpfcc linux-headers-amd64 stress-ng prometheus tshark tcpdump"
say() { printf '[setup] %s\n' "$*"; }
warn() { printf '[setup] WARNING: %s\n' "$*" >&2; }

is_root() { [ "$(id -u)" = 0 ]; }

install_system_packages() {
    local missing=""
    for p in $SYS_PKGS; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
    done
    [ -z "$missing" ] && { say "system packages present"; return; }
    if ! is_root || ! command -v apt-get >/dev/null; then
        warn "cannot install:$missing (needs root and apt-get)."
        warn "without them: eBPF capture (python3-bpfcc, linux-headers-amd64), stress-ng CPU contention,"
        warn "promtool rule tests (prometheus), tshark export checks and tcpdump import checks are skipped."
        return
    fi
    say "installing:$missing"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null 2>&1 || warn "apt-get update failed"
    # shellcheck disable=SC2086
    apt-get install -y -q --no-install-recommends $missing >/tmp/shadowtest-apt.log 2>&1 \
        || warn "apt-get install failed (see /tmp/shadowtest-apt.log); the tests that need$missing will skip"
}

link_kernel_headers() {
    # The running kernel may be a custom build with no headers; bcc only needs a matching-enough tree
    # for its tracepoint programs, so point /lib/modules/$(uname -r)/{build,source} at Debian's headers.
    local rel mod hdr common
    rel=$(uname -r); mod=/lib/modules/$rel
    [ -e "$mod/build/include" ] && { say "kernel headers for $rel present"; return; }
    hdr=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -1)
    common=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -1)
    if [ -z "$hdr" ]; then warn "no kernel headers under /usr/src: eBPF capture unavailable"; return; fi
    if ! is_root; then warn "not root: cannot link $hdr to $mod/build; eBPF capture unavailable"; return; fi
    mkdir -p "$mod" && ln -sfn "$hdr" "$mod/build" && ln -sfn "${common:-$hdr}" "$mod/source"
    say "linked $mod/build -> $hdr"
}

mount_tracefs() {
    # Tracepoint attachment needs tracefs; minimal containers often boot without it.
    is_root || return 0
    [ -e /sys/kernel/tracing/events ] || mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null \
        || warn "could not mount tracefs: eBPF tracepoints unavailable"
    [ -e /sys/kernel/debug/tracing ] || mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null || true
}

make_venv() {
    local stamp="$VENV/.shadowtest-stamp" want
    want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
    if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
        say "virtual environment up to date"
    else
        [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV" || { warn "python3 -m venv failed"; exit 1; }
        say "installing shadowtest[agent,dev] into $VENV (pinned by constraints.txt)"
        "$VENV/bin/pip" install -q --disable-pip-version-check -c constraints.txt -e '.[agent,dev]' \
            || { warn "pip install failed"; exit 1; }
        echo "$want" > "$stamp"
    fi
    # bcc ships only as a Debian package; expose just that module to the venv's interpreter.
    local site; site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    if [ -d /usr/lib/python3/dist-packages/bcc ] && [ ! -e "$site/bcc" ]; then
        ln -sfn /usr/lib/python3/dist-packages/bcc "$site/bcc"
    fi
}

install_system_packages
link_kernel_headers
mount_tracefs
make_venv
say "done"
