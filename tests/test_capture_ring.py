"""The flight recorder's trigger endpoint and window parsing (capture/ring.py), on a real loopback HTTP
server: Alertmanager's payload accepted, hostile bodies refused with a status and one log line."""

from __future__ import annotations

import http.client
import json
from typing import Any

import pytest

from capture.errors import CaptureError
from capture.ring import MAX_BODY, TriggerRefused, TriggerServer, alert_of, dump_name, parse_window

ALERT = {"version": "4", "status": "firing", "commonLabels": {"alertname": "P99High"},
         "alerts": [{"status": "firing", "labels": {"alertname": "P99High", "service": "agent"}}]}


def test_windows() -> None:
    assert [parse_window(t) for t in ("90s", "10m", "1h", "600", "1.5m")] == [90, 600, 3600, 600, 90]
    for bad in ("", "0", "-5s", "10 minutes", "5d"):
        with pytest.raises(CaptureError, match="--ring"):
            parse_window(bad)


def test_alertmanager_payloads() -> None:
    assert alert_of(json.dumps(ALERT).encode()) == ("P99High", {"alertname": "P99High", "service": "agent"})
    only_labels = {"alerts": [{"labels": {"alertname": "DependencySlow"}}]}
    assert alert_of(json.dumps(only_labels).encode())[0] == "DependencySlow"
    for bad, why in ((b"{", "not JSON"), (b"[]", "no alerts"), (b'{"alerts": []}', "no alerts"),
                     (b'{"alerts": [1]}', "no labels"), (b'{"alerts": [{"labels": {}}]}', "no alertname"),
                     (b"\xff\xfe", "not JSON")):
        with pytest.raises(CaptureError, match=why):
            alert_of(bad)
    long = {"alerts": [{"labels": {"alertname": "x" * 5000, **{f"k{i}": "v" * 999 for i in range(200)}}}]}
    name, labels = alert_of(json.dumps(long).encode())
    assert len(name) == 100 and len(labels) == 50 and all(len(v) <= 200 for v in labels.values())
    assert dump_name("P99 High/../x", 0).endswith("-P99_High_.._x.rec") and dump_name("P99", 0).startswith("1970")


def _post(port: int, body: bytes | None, headers: dict[str, str] | None = None) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.putrequest("POST", "/")
    for k, v in (headers or {}).items():
        conn.putheader(k, v)
    if body is not None and "Content-Length" not in (headers or {}):
        conn.putheader("Content-Length", str(len(body)))
    conn.endheaders()
    if body:
        conn.send(body)
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, text


def test_trigger_endpoint_answers_each_kind_of_request(capsys: pytest.CaptureFixture[str]) -> None:
    got: list[tuple[str, dict[str, str]]] = []
    refuse = [False]

    def on_alert(name: str, labels: dict[str, str]) -> None:
        if refuse[0]:
            raise TriggerRefused("too soon")
        got.append((name, labels))

    server = TriggerServer("127.0.0.1:0", on_alert)
    port = int(server.address.rsplit(":", 1)[1])
    try:
        assert _post(port, json.dumps(ALERT).encode())[0] == 202
        assert got == [("P99High", {"alertname": "P99High", "service": "agent"})]
        status, text = _post(port, b"not json")
        assert status == 400 and "not JSON" in text
        assert _post(port, b"x" * 10, {"Content-Length": str(MAX_BODY + 1)})[0] == 413   # refused before reading
        assert _post(port, None)[0] == 411
        refuse[0] = True
        assert _post(port, json.dumps(ALERT).encode()) == (429, "too soon\n")
        counts: dict[str, Any] = server.counts
        assert counts == {"accepted": 1, "malformed": 1, "rate_limited": 1}
    finally:
        server.close()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "trigger: malformed webhook from 127.0.0.1: not JSON" in err
    with pytest.raises(CaptureError, match="HOST:PORT"):
        TriggerServer("9099", on_alert)
