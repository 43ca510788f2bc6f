"""Recordings whose calls are decoded after capture: is a file waiting, and what to tell the user.

    --decode at-stop   masked chunks while recording; stop() decodes them on the recorded host
    --decode later     masked chunks while recording; stop() closes the file with
                       meta.calls_decoded = false, and `shadowtest record --finish -o FILE`
                       decodes them on any machine (no root, no bcc)

A file is waiting when its `meta.decode` is one of these and `meta.calls_decoded` is not true: a
`later` file after its stop, or an `at-stop` file whose recorder was killed before decoding.
Readers that need calls (inspect, replay) ask `calls_pending` instead of replaying nothing.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from typing import Any

DEFERRED_MODES = ("at-stop", "later")


def calls_pending(meta: Mapping[str, Any]) -> bool:
    """True when the recording holds chunks whose calls have not been decoded yet."""
    return meta.get("decode") in DEFERRED_MODES and not meta.get("calls_decoded")


def finish_command(path: str | os.PathLike[str]) -> str:
    """The command that decodes the file's calls, quoted for a shell."""
    return f"shadowtest record --finish -o {shlex.quote(str(path))}"


def pending_message(path: str | os.PathLike[str], meta: Mapping[str, Any]) -> str:
    """One line for the user: why there are no calls, and the command that fixes it."""
    why = ("recorded with --decode later" if meta.get("decode") == "later"
           else "recorded with --decode at-stop and never stopped")
    return (f"calls not decoded yet ({why}): run `{finish_command(path)}` "
            "on any machine (no root or bcc needed)")
