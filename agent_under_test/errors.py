"""Exceptions raised by the reference agent (server, launcher, traffic generator).

    AgentError                    root: catch this to catch everything below
    +-- InvalidSnapshotError      a request is malformed; `.field` names the offending field
    +-- ServeError                the server cannot start (port in use, bad weights, no CUDA)
    +-- LaunchError               an agent subprocess did not become ready; carries its stderr tail
    +-- TrafficError              the traffic generator cannot run (bad target, bad options)

Foreign exceptions (grpc, torch, OSError) are mapped at the boundary with ``raise ... from exc``
so the CLI can print one line that says what to do.
"""

from __future__ import annotations


class AgentError(Exception):
    """Root of every error raised by `agent_under_test`."""


class InvalidSnapshotError(AgentError):
    """A snapshot failed validation; served as INVALID_ARGUMENT. `field` is e.g. 'levels[3].bid_price'."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


class ServeError(AgentError):
    """The agent server could not start or load its model."""


class LaunchError(AgentError):
    """An agent subprocess exited or timed out before it printed its ready line."""


class TrafficError(AgentError):
    """The traffic generator was given options or a target it cannot use."""
