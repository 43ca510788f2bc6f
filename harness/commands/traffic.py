"""`shadowtest traffic`: production-like open-loop load against an agent (see agent_under_test.traffic)."""

from __future__ import annotations

from agent_under_test.cli import traffic_command as command

__all__ = ["command"]
