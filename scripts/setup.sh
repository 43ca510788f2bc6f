#!/usr/bin/env bash
# Idempotent set-up for `make test` / `make demo`: system packages, kernel headers for bcc,
# tracefs, the virtual environment at .venv and the node modules of the grpc-js interop tests.
# A second run with nothing changed takes seconds.
# Where a step cannot be done (not root, no apt) it says what is missing and what is lost, and goes on.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
SYS_PKGS="python3-bpfcc linux-headers-amd64 stress-ng prometheus tshark tcpdump nghttp2-client"
NODE_DIR=tests/interop/node
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
        warn "promtool rule tests (prometheus), tshark export checks, tcpdump import checks and the h2load"
        warn "interop tests (nghttp2-client: tests/test_interop_h2load.py) are skipped."
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
        say "installing shadowtest[all,dev] into $VENV (pinned by constraints.txt)"
        "$VENV/bin/pip" install -q --disable-pip-version-check -c constraints.txt -e '.[all,dev]' \
            || { warn "pip install failed"; exit 1; }
        echo "$want" > "$stamp"
    fi
    # bcc ships only as a Debian package; expose just that module to the venv's interpreter.
    local site; site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    if [ -d /usr/lib/python3/dist-packages/bcc ] && [ ! -e "$site/bcc" ]; then
        ln -sfn /usr/lib/python3/dist-packages/bcc "$site/bcc"
    fi
}

install_node_modules() {
    # @grpc/grpc-js for tests/test_interop_grpcjs.py, pinned by the committed package-lock.json.
    # Reinstalled only when package.json or package-lock.json changed since the last `npm ci`.
    local stamp="$NODE_DIR/node_modules/.shadowtest-stamp" want
    [ -f "$NODE_DIR/package-lock.json" ] || return 0
    if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
        warn "node/npm not found: the grpc-js interop tests (tests/test_interop_grpcjs.py) are skipped"
        return
    fi
    want=$(cat "$NODE_DIR/package.json" "$NODE_DIR/package-lock.json" | sha256sum | cut -d' ' -f1)
    if [ -d "$NODE_DIR/node_modules" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
        say "node modules for the interop tests up to date"
        return
    fi
    say "installing @grpc/grpc-js for the interop tests (npm ci in $NODE_DIR)"
    if (cd "$NODE_DIR" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error) \
            >/tmp/shadowtest-npm.log 2>&1; then
        echo "$want" > "$stamp"
    else
        rm -rf "$NODE_DIR/node_modules"  # nothing half-installed: the tests skip instead of failing
        warn "npm ci failed (see /tmp/shadowtest-npm.log): the grpc-js interop tests"
        warn "(tests/test_interop_grpcjs.py) will skip"
    fi
}

install_system_packages
link_kernel_headers
mount_tracefs
make_venv
install_node_modules
say "done"
