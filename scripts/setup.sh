#!/usr/bin/env bash
# Idempotent set-up for `make test` / `make demo`: system packages, kernel headers for bcc,
# tracefs, the virtual environment at .venv and the node modules of the grpc-js interop tests.
# A second run with nothing changed takes seconds.
# Where a step cannot be done (not root, no apt) it says what is missing and what is lost, and goes on.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
# One Debian/Ubuntu package per line: name, then what is lost without it. Each is installed on its own,
# so one that a distribution lacks costs only its own line. Kernel headers are handled apart (below).
PACKAGES="
python3-bpfcc      eBPF capture (record --backend ebpf) and the tests that load eBPF programs
stress-ng          CPU contention faults (cpu: contention) and their tests
prometheus         promtool rule tests and alerts judged by a real Prometheus (its service is not left running)
tshark             the export checks that read our pcapng back with Wireshark's dissectors
tcpdump            the import checks that compare with tcpdump's own capture
nghttp2-client     the h2load interop tests (tests/test_interop_h2load.py)
nginx              the TLS replay tests against a real HTTPS server and the nginx capture tests (test_capture_nginx.py)
wrk                the load in the nginx capture tests (tests/test_capture_nginx.py)
curl               the HTTPS client of the TLS capture tests (tests/test_capture_tls.py)
gcc                the agent cache's compiled kernel (agent_under_test/_similarity.c; without it a numpy reference serves, slower misses)
redis-server       the agent's Redis cache tier and its outage tests (tests/test_agent_cache.py; its service is not left running)
golang-go          the Go crypto/tls tests, which build Go peers (tests/test_capture_goelf.py, test_capture_go_tls.py)
golang-google-grpc-dev  the grpc-go TLS server the Go capture test records (tests/test_capture_go_tls.py)
podman             the recorder's image built and run in tests/test_deploy_image.py (deploy/recorder/)
runc               the container runtime for that test where crun refuses the host's cgroups (v1 and v2 mounted)
debootstrap        the Debian root filesystem that image is built from (no image registry is needed)
"
NODE_DIR=tests/interop/node
say() { printf '[setup] %s\n' "$*"; }
warn() { printf '[setup] WARNING: %s\n' "$*" >&2; }

is_root() { [ "$(id -u)" = 0 ]; }

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

APT_UPDATED=""
apt_install() {   # apt_install PKG: 0 when installed now or before
    installed "$1" && return 0
    is_root && command -v apt-get >/dev/null || return 1
    export DEBIAN_FRONTEND=noninteractive
    if [ -z "$APT_UPDATED" ]; then
        apt-get update -q >/dev/null 2>&1 || warn "apt-get update failed"
        APT_UPDATED=1
    fi
    # policy-rc.d 101: packages that ship a service (prometheus) install without starting it
    local policy=/usr/sbin/policy-rc.d made_policy=""
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && made_policy=1
    fi
    apt-get install -y -q --no-install-recommends "$1" >>/tmp/shadowtest-apt.log 2>&1
    local rc=$?
    [ -n "$made_policy" ] && rm -f "$policy"
    return $rc
}

install_system_packages() {
    local name cost lost=0
    if ! is_root || ! command -v apt-get >/dev/null; then
        warn "not root or no apt-get: system packages are not installed by this script"
    fi
    while read -r name cost; do
        [ -z "$name" ] && continue
        installed "$name" && continue
        say "installing $name"
        if ! apt_install "$name"; then
            warn "$name not installed (see /tmp/shadowtest-apt.log); lost: $cost"
            lost=$((lost + 1))
        fi
    done <<< "$PACKAGES"
    # A package that ships a service must not leave one running or enabled: only its binaries are used.
    for svc in prometheus redis-server; do
        if installed "$svc" && command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
            systemctl disable --now "$svc" >/dev/null 2>&1 || true
        fi
    done
    [ "$lost" = 0 ] && say "system packages present"
}

install_kernel_headers() {
    # bcc compiles its programs against kernel headers: the running kernel's own package first,
    # then the distribution's meta-package (Debian: linux-headers-<arch>, Ubuntu: linux-headers-generic).
    local rel arch p
    rel=$(uname -r)
    [ -e "/lib/modules/$rel/build/include" ] && return 0
    arch=$(dpkg --print-architecture 2>/dev/null || echo amd64)
    for p in "linux-headers-$rel" "linux-headers-$arch" linux-headers-generic; do
        installed "$p" && return 0
        apt-cache show "$p" >/dev/null 2>&1 || continue
        say "installing kernel headers: $p"
        apt_install "$p" && return 0
    done
    warn "no kernel headers package found for $rel; lost: eBPF capture (bcc cannot compile its programs)"
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
    want=$(cat pyproject.toml constraints.txt agent_under_test/_similarity.c | sha256sum | cut -d' ' -f1)
    if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
        say "virtual environment up to date"
    else
        if [ ! -x "$VENV/bin/python" ] && ! "$PY" -m venv "$VENV" >/dev/null 2>&1; then
            # Debian and Ubuntu ship venv (ensurepip) apart from python3
            rm -rf "$VENV"
            local ver; ver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
            say "python3 -m venv needs python${ver}-venv: installing it"
            apt_install "python${ver}-venv" || apt_install python3-venv \
                || { warn "python3 -m venv failed and python3-venv could not be installed (needs root and apt)"; exit 1; }
            "$PY" -m venv "$VENV" || { warn "python3 -m venv failed"; exit 1; }
        fi
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

install_python_headers() {
    # The cache kernel is a C extension: it needs the interpreter's own headers (pyenv and python.org
    # builds have them; Debian's python3 keeps them in python3.X-dev).
    "$PY" -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
        && return 0
    local ver; ver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    say "no Python.h for $PY: installing python${ver}-dev"
    apt_install "python${ver}-dev" || apt_install python3-dev \
        || warn "no Python headers: the cache kernel is not built (a numpy reference serves, slower misses)"
}

install_system_packages
install_kernel_headers
link_kernel_headers
install_python_headers
mount_tracefs
make_venv
install_node_modules
say "done"
