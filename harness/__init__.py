"""Scenarios, runner, checks, reports and the `shadowtest` command line."""

__version__ = "0.1.0"
