"""Exceptions raised by the capture package.

    CaptureError                  root: catch this to catch everything below
    +-- RecordingError            a recording file cannot be created, opened or written
    |   +-- CorruptRecordingError the file is damaged; `.salvaged` says what could still be read
    +-- PcapError                 a pcap/pcapng file cannot be read or written
    +-- DecodeError               a protocol stream could not be decoded (the raw chunks are kept)
    +-- PrivilegeError            the backend needs a privilege or package this host lacks;
                                  the message says what to install or run

Foreign exceptions (sqlite3, bcc, scapy, OSError) are mapped at the boundary with
``raise ... from exc`` so the CLI can print one line that says what to do.
"""

from __future__ import annotations


class CaptureError(Exception):
    """Root of every error raised by `capture`."""


class RecordingError(CaptureError):
    """A recording file cannot be created, opened or written."""


class CorruptRecordingError(RecordingError):
    """The recording is damaged. `salvaged` counts what could still be read (may be empty)."""

    def __init__(self, message: str, salvaged: dict[str, int] | None = None) -> None:
        super().__init__(message)
        self.salvaged = salvaged or {}


class PcapError(CaptureError):
    """A pcap or pcapng file cannot be read or written."""


class DecodeError(CaptureError):
    """A protocol stream could not be decoded."""


class PrivilegeError(CaptureError):
    """The capture backend needs a privilege or a package that this host lacks."""
