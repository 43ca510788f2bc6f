"""Flight recorder (`record --ring 10m -o DIR [--ring-mb N] [--trigger-listen 127.0.0.1:9099]`): keep only the
last window of traffic, and write it out as a recording when something goes wrong.

    the recorder --rotates every window/10--> DIR/.ring/000001.rec, 000002.rec, ...  (older than the window,
                                              or beyond --ring-mb, deleted)
    a trigger: SIGUSR1, or an Alertmanager webhook POSTed to --trigger-listen
        --> the current file is closed, the files that started within the window are merged into
            DIR/<UTC time>-<alert name>.rec, with the alert's name and labels in its meta (`trigger`)

so the dump holds the window less at most one slice (window/10, at least 1 s, rotated on the recorder's
0.25 s tick): 90-100 % of a 10 s or longer window, never more; the calls in it are whole (the rotation
never splits a call: capture/rotate.py). Triggers are hostile input like any other: the webhook
takes at most MAX_BODY bytes, answers a malformed payload with 400 and one log line, and dumps at most
once per `min_interval_s` (429 otherwise); it listens on loopback unless told otherwise.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from capture.errors import CaptureError

MAX_BODY = 256 << 10      # an Alertmanager notification batches alerts: far below this
SLICES = 10               # files per window


class TriggerRefused(CaptureError):
    """A trigger that came too soon after the last dump (rate limit)."""


def parse_window(text: str) -> float:
    """'10m', '90s', '1h', '600' -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise CaptureError(f"--ring {text!r}: give a duration such as 90s, 10m or 1h")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def alert_of(body: bytes) -> tuple[str, dict[str, str]]:
    """(alert name, labels) of an Alertmanager webhook payload; CaptureError when it is not one."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CaptureError(f"not JSON ({exc})") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("alerts"), list) or not doc["alerts"]:
        raise CaptureError("not an Alertmanager notification (no alerts list)")
    first = doc["alerts"][0]
    labels = first.get("labels") if isinstance(first, dict) else None
    common = doc.get("commonLabels")
    if not isinstance(common, dict):
        common = {}
    if not isinstance(labels, dict):
        raise CaptureError("the first alert has no labels")
    name = common.get("alertname") or labels.get("alertname")
    if not isinstance(name, str) or not name:
        raise CaptureError("no alertname label")
    clean = {str(k)[:100]: str(v)[:200] for k, v in list(labels.items())[:50]}
    return name[:100], clean


def dump_name(name: str, now: float | None = None) -> str:
    stamp = datetime.fromtimestamp(time.time() if now is None else now, tz=UTC).strftime("%Y%m%dT%H%M%SZ")
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:60] or "trigger"
    return f"{stamp}-{safe}.rec"


class TriggerServer:
    """The webhook endpoint: POST an Alertmanager notification (any path) -> `on_alert(name, labels)`,
    which raises TriggerRefused when rate limited. Runs in a thread; `close()` ends it."""

    def __init__(self, address: str, on_alert: Callable[[str, dict[str, str]], None]) -> None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise CaptureError(f"--trigger-listen {address!r}: give HOST:PORT (127.0.0.1:9099)")
        self.counts = {"accepted": 0, "malformed": 0, "rate_limited": 0}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server interface
                length = self.headers.get("Content-Length")
                if length is None or not length.isdigit() or int(length) > MAX_BODY:
                    outer._answer(self, 413 if length and length.isdigit() else 411, "body: Content-Length up to "
                                  f"{MAX_BODY} bytes")
                    return
                body = self.rfile.read(int(length))
                try:
                    name, labels = alert_of(body)
                except CaptureError as exc:
                    outer.counts["malformed"] += 1
                    print(f"trigger: malformed webhook from {self.client_address[0]}: {exc}", file=sys.stderr)
                    outer._answer(self, 400, str(exc))
                    return
                try:
                    on_alert(name, labels)
                except TriggerRefused as exc:
                    outer.counts["rate_limited"] += 1
                    outer._answer(self, 429, str(exc))
                    return
                outer.counts["accepted"] += 1
                outer._answer(self, 202, f"dumping the last window for {name}")

            def log_message(self, *args: Any) -> None:
                pass

        try:
            self.httpd = ThreadingHTTPServer((host, int(port)), Handler)
        except OSError as exc:
            raise CaptureError(f"--trigger-listen {address}: {exc.strerror or exc}") from exc
        self.httpd.daemon_threads = True
        self.address = f"{host}:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="ring-trigger", daemon=True)
        self._thread.start()

    @staticmethod
    def _answer(handler: BaseHTTPRequestHandler, code: int, text: str) -> None:
        body = (text + "\n").encode()
        handler.send_response(code)
        handler.send_header("Content-Type", "text/plain")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(5)


def ring_dir(output: str | Path) -> Path:
    return Path(output) / ".ring"
