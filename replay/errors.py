"""Exceptions raised by the replay package.

    ReplayError                 root: catch this to catch everything below
    +-- TargetNotAllowedError   the target is not loopback and not on the allowlist
    +-- PlanError               the options select nothing or make no sense (bad window, speed)
    +-- SenderError             a sender cannot be created (unknown name, bad target)
    +-- CompareError            response comparison cannot get descriptors (reflection failed)

Foreign exceptions (grpc, OSError, capture's RecordingError) are mapped at the boundary with
``raise ... from exc`` so the CLI prints one line that says what to do.
"""

from __future__ import annotations


class ReplayError(Exception):
    """Root of every error raised by `replay`."""


class TargetNotAllowedError(ReplayError):
    """The target is not loopback and not allowed through --allow-target or the allowlist."""


class PlanError(ReplayError):
    """The replay options are invalid or select no calls."""


class SenderError(ReplayError):
    """A sender cannot be created or cannot reach its target at all."""


class CompareError(ReplayError):
    """Response comparison cannot proceed (no descriptors for the methods)."""
