"""Exceptions raised by the faults package.

    FaultsError                   root: catch this to catch everything below
    +-- ProxyApiError             the Toxiproxy-compatible API refused a request (`.status` is the HTTP code)
    +-- ProxyUnavailableError     no proxy server could be reached or started
    +-- StateError                the crash-safe state directory cannot be read or written
    +-- CpuFaultError             CPU contention or a cgroup quota could not be applied or undone
    +-- ProcessFaultError         a process could not be paused, killed or restarted
    +-- GpuUnavailableError       no CUDA device (or no torch) for a GPU fault

Foreign exceptions (OSError, requests, subprocess) are mapped at the boundary with
``raise ... from exc`` so the CLI can print one line that says what to do.
"""

from __future__ import annotations


class FaultsError(Exception):
    """Root of every error raised by `faults`."""


class ProxyApiError(FaultsError):
    """The proxy API answered with an error body ``{"error": ..., "status": ...}``."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class ProxyUnavailableError(FaultsError):
    """No Toxiproxy (real or embedded) could be reached or started."""


class StateError(FaultsError):
    """The fault state directory cannot be used."""


class CpuFaultError(FaultsError):
    """CPU contention or a cgroup quota could not be applied or undone."""


class ProcessFaultError(FaultsError):
    """A process fault (pause, kill, restart) failed."""


class GpuUnavailableError(FaultsError):
    """A GPU fault was asked for on a host without a usable CUDA device."""
