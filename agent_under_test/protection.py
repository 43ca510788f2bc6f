"""Self-protection for the agent: builds the Guard from its configuration.

Placeholder until the limiter/alerts work lands (issue 3): no protection at all.
"""

from __future__ import annotations

from agent_under_test.hooks import Guard, GuardConfig, NullGuard


def build_guard(config: GuardConfig) -> Guard:
    return NullGuard(config.tier)
