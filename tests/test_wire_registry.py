"""wire/registry.py: one shape for every table of implementations, and every choice read from its table.

A registry imports a "module:attr" entry on first use, keeps registration order, and refuses an
unknown (or unhashable) name with its own error class in one line that lists the names. Every
registry of the product resolves each entry it lists (a typo in a lazy entry fails here, not in a
user's run), and every place that offers a choice (a command's option, a scenario's parameter) offers
exactly the registry's names.
"""

from __future__ import annotations

import sys
from typing import Any

import click
import pytest

from agent_under_test.arrivals import PATTERNS
from agent_under_test.cli import serve_command, traffic_command
from agent_under_test.config import LIMITERS
from agent_under_test.degrade import TIERS
from capture.backends import BACKENDS
from capture.decode import DECODERS
from faults.cleanup import UNDO
from faults.cpu import METHODS
from faults.proxy.toxics import TOXICS
from harness.checks import CHECKS
from harness.cli import cli
from harness.faultapi import APPLIERS
from harness.faultrun import FaultSession  # noqa: F401  (importing it registers the appliers)
from harness.scenario_load import AGENT_OPTIONS
from replay.options import BY_NAME
from replay.senders import SENDERS
from wire.registry import Registry, UnknownName


class Oops(ValueError):
    pass


def test_a_lazy_entry_is_imported_on_first_use_only() -> None:
    sys.modules.pop("colorsys", None)
    reg: Registry[str, Any] = Registry("converter", {"hls": "colorsys:rgb_to_hls"})
    assert "colorsys" not in sys.modules and reg.names() == ("hls",)
    assert reg.get("hls")(1.0, 0.0, 0.0) == (0.0, 0.5, 1.0)
    assert "colorsys" in sys.modules


def test_unknown_and_hostile_names_raise_the_registrys_error_in_one_line() -> None:
    reg: Registry[str, int] = Registry("widget", {"b": 2}, error=Oops)
    reg.add("a", 1)

    @reg.register("c", "d")
    def _c() -> None: ...

    assert reg.names() == ("b", "a", "c", "d") and reg["a"] == 1 and reg.get("d") is _c and len(reg) == 4
    with pytest.raises(Oops, match=r"^unknown widget 'x'; expected one of: b, a, c, d$"):
        reg.get("x")
    with pytest.raises(Oops):
        reg.get(["not", "hashable"])   # type: ignore[arg-type]  # what a hostile JSON body could hold
    assert ["not", "hashable"] not in reg and reg.find("x") is None
    with pytest.raises(UnknownName):
        Registry("thing").get("x")
    keyed: Registry[tuple[str, str], int] = Registry("fault")
    with pytest.raises(UnknownName, match="unknown fault 'cpu:melt'"):
        keyed.get(("cpu", "melt"))


@pytest.mark.parametrize("registry", [SENDERS, BACKENDS, DECODERS, TOXICS, CHECKS, APPLIERS, LIMITERS, PATTERNS,
                                      METHODS, UNDO], ids=lambda r: r.what)
def test_every_product_registry_resolves_every_entry_it_lists(registry: Registry[Any, Any]) -> None:
    assert len(registry) > 0
    for name, entry in registry.items():
        assert entry is not None and not isinstance(entry, str), name


def _choices(command: click.Command, option: str) -> tuple[str, ...]:
    param = next(p for p in command.params if option in getattr(p, "opts", ()))
    assert isinstance(param.type, click.Choice)
    return tuple(param.type.choices)


def test_every_offered_choice_is_its_registrys_names() -> None:
    assert _choices(cli.commands["record"], "--backend") == BACKENDS.names()
    assert _choices(cli.commands["capacity"], "--pattern") == PATTERNS.names()
    assert _choices(cli.commands["capacity"], "--limiter") == LIMITERS.names()
    assert _choices(cli.commands["capacity"], "--tier") == TIERS
    assert _choices(serve_command, "--limiter") == LIMITERS.names()
    assert _choices(traffic_command, "--pattern") == PATTERNS.names()
    assert _choices(cli.commands["replay"], "--sender") == ("auto", *SENDERS.names())
    assert BY_NAME["sender"].choices == ("auto", *SENDERS.names())
    assert AGENT_OPTIONS["limiter"].type == "choice:" + ",".join(LIMITERS.names())
    assert AGENT_OPTIONS["tier"].type == "choice:" + ",".join(TIERS)
