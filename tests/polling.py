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
