"""A Debian nginx started by a test: its own config, pid file and logs in a temp dir, a free loopback
port, in the foreground (master_process off: one process, ended by its PID)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from wire.process import free_port, spawn

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)

# What every test's config starts with; `{d}` is the nginx directory.
PREAMBLE = """
daemon off;
master_process off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 64; }}
"""
TEMP_PATHS = """
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
"""


def make_cert(d: Path) -> Path:
    """A self-signed certificate for 127.0.0.1 (d/cert.pem, its key d/key.pem), for a TLS server and
    the clients that trust it (--cacert, cafile=)."""
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem"), "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=30)
    return d / "cert.pem"



@contextlib.contextmanager
def running_nginx(d: Path, conf: Callable[[int], str]) -> Iterator[int]:
    """nginx with the config `conf(port)` written to d/nginx.conf; yields the port once it accepts.
    A free port can be taken between our probe and nginx's bind: then another is tried."""
    assert NGINX is not None
    for _ in range(5):
        port = free_port()
        (d / "nginx.conf").write_text(conf(port))
        proc = spawn([NGINX, "-p", str(d), "-c", str(d / "nginx.conf")])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
            time.sleep(0.05)
        else:
            proc.kill()
            proc.wait(10)
            continue
        break
    else:
        log = d / "error.log"
        pytest.fail(f"nginx did not start: {log.read_text() if log.exists() else ''}")
    try:
        yield port
    finally:
        proc.send_signal(signal.SIGQUIT)   # graceful: finishes writing its log
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
