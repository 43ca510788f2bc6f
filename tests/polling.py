"""Waiting in tests for something another thread or process makes true."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(condition: Callable[[], object], timeout_s: float = 5.0, every_s: float = 0.01) -> bool:
    """Whether `condition()` came true within `timeout_s` (checked every `every_s`, and once more at the end)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every_s)
    return bool(condition())


def recording_meta(path: object) -> dict[str, object]:
    """The meta of the recording at `path` as far as it can be read now ({} while it is being created):
    a recorder started in another process is up once its meta has `backend_settings`."""
    from capture.recording import Recording

    try:
        with Recording(str(path)) as r:
            return dict(r.meta)
    except Exception:  # noqa: BLE001 - being created
        return {}
