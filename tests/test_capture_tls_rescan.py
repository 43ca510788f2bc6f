"""TLS discovery reads a recorded process again only after it opened another flow (root + bcc).

The recorder inspects each process that opens a recorded flow for TLS libraries (its /proc/PID/maps and
the files mapped there): it may have exec'd or loaded a library since the last look. A service whose
connections stay open opens no flow, yet it was read again every RESCAN_S for as long as the recorder
ran (~1.5 ms of the recorder's CPU a second for the agent). Here a real HTTP server is recorded: one
connection gets it inspected, three quiet seconds get it inspected no more, and the next connection gets
it inspected again within RESCAN_S; every call is in the recording.
"""

from __future__ import annotations

import socket
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from capture.backends import RecordOptions
from capture.ebpf.tls import RESCAN_S, find_libssl
from capture.ebpf.tlslibs import ProcessTls
from capture.record import Recorder
from capture.recording import Recording
from tests.polling import wait_for
from wire.process import end_child, free_port, spawn

pytestmark = [pytest.mark.root, pytest.mark.ebpf,
              pytest.mark.skipif(find_libssl() is None, reason="no system libssl.so.3: TLS discovery is off")]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _get(port: int) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
        r.read()


def test_a_process_is_inspected_again_only_after_it_opens_another_flow(tmp_path: Path) -> None:
    port = free_port()
    server = spawn([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                    "--directory", str(tmp_path)])
    try:
        assert wait_for(lambda: _listening(port), 10), "http.server did not start"
        out = tmp_path / "r.rec"
        rec = Recorder(RecordOptions(output=str(out), backend="ebpf", port=port))
        rec.start()
        looked: Counter[int] = Counter()
        try:
            inspector = rec.backend.inspector
            real = inspector.process

            def counted(pid: int) -> ProcessTls:      # the real inspection, counted per process
                looked[pid] += 1
                return real(pid)

            inspector.process = counted
            _get(port)
            assert wait_for(lambda: looked[server.pid] >= 1, 3 * RESCAN_S), "its first flow got no look"
            time.sleep(3 * RESCAN_S)                   # no flow opens: no look
            assert looked[server.pid] == 1, f"read {looked[server.pid]} times with one flow opened"
            _get(port)
            assert wait_for(lambda: looked[server.pid] >= 2, 3 * RESCAN_S), "its next flow got no look"
        finally:
            rec.stop()
    finally:
        end_child(server)
    assert looked[server.pid] == 2
    with Recording(str(out)) as r:
        assert [(c.method, c.status) for c in r.calls()] == [("GET /", 200), ("GET /", 200)]
