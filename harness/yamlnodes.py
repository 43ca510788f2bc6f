"""YAML nodes that know where they are: every error names the file, the line and what was expected.

`yaml.compose` keeps each node's start mark; values are built with the safe constructor, so
a scenario can never run code. Numbers are range-checked against a `Bound`, and a value out of
range is named as the file wrote it: ``s.yaml:8: traffic.generator.rate -5 must be between 0.1
and 100000 calls/s``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any, NoReturn

import yaml

from harness.errors import ScenarioError
from wire.durations import format_duration, parse_duration

# YAML 1.2's float form. PyYAML (YAML 1.1) reads a plain `1e12` or `1.0e12` as a string; as a
# number field's value it is meant as a number, so it is taken as one (and then range-checked).
_FLOAT_12 = re.compile(r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?")


def _shown(x: float) -> str:
    """A bound as people write it: 100000, not 100000.0 or 1e+05; 0.1 stays 0.1."""
    if isinstance(x, int):
        return str(x)
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


@dataclass(frozen=True)
class Bound:
    """The range a scenario number must fall in, and how to say it.

    `lo` is allowed unless `above` (then the value must be more than `lo`); `hi` is allowed.
    `whole`: only whole numbers (a float such as 1e12 or 2.0 is refused where a count is meant).
    `duration`: the bounds are seconds, shown as durations (0s, 24h). `unit` follows the range,
    `note` follows the unit (e.g. why the range is what it is on this machine).
    """

    lo: float | None = None
    hi: float | None = None
    unit: str = ""
    above: bool = False
    whole: bool = False
    duration: bool = False
    note: str = ""

    def show(self, x: float) -> str:
        if self.duration:
            return "0s" if x == 0 else format_duration(x)
        return _shown(x)

    def rule(self) -> str:
        """'between 0.1 and 100000 calls/s', 'a whole number more than 0 and at most 10 KB/s', ..."""
        lo, hi = (None if b is None else self.show(b) for b in (self.lo, self.hi))
        if lo is not None and hi is not None:
            text = f"more than {lo} and at most {hi}" if self.above else f"between {lo} and {hi}"
        elif lo is not None:
            text = f"more than {lo}" if self.above else f"at least {lo}"
        elif hi is not None:
            text = f"at most {hi}"
        else:
            text = "a finite number"
        if self.whole:
            text = "a whole number" + ("" if text == "a finite number" else " " + text)
        unit = "" if not self.unit or self.duration else (self.unit if self.unit.startswith("%") else " " + self.unit)
        return text + unit + (f" {self.note}" if self.note else "")

    def allows(self, v: float) -> bool:
        if isinstance(v, float) and not math.isfinite(v):
            return False
        if self.whole and not isinstance(v, int):
            return False
        if self.lo is not None and (v <= self.lo if self.above else v < self.lo):
            return False
        return self.hi is None or v <= self.hi


class Node:
    """A composed YAML node plus the file it came from."""

    def __init__(self, node: yaml.Node, file: str, loader: yaml.SafeLoader) -> None:
        self.node = node
        self.file = file
        self._loader = loader

    @property
    def line(self) -> int:
        return self.node.start_mark.line + 1

    def fail(self, message: str) -> NoReturn:
        raise ScenarioError(message, self.file, self.line)

    @property
    def text(self) -> str:
        """The value as the file wrote it (a scalar's source text)."""
        if isinstance(self.node, yaml.ScalarNode):
            return str(self.node.value)
        return self.kind_name

    def check(self, what: str, value: float, bound: Bound | None) -> None:
        """Fail with one line (``WHAT VALUE must be RULE``) when `value` is outside `bound`."""
        if bound is not None and not bound.allows(value):
            self.fail(f"{what} {self.text} must be {bound.rule()}")

    def _wrap(self, node: yaml.Node) -> Node:
        return Node(node, self.file, self._loader)

    def mapping(self, what: str) -> dict[str, Node]:
        """The mapping's entries by key; fails on a non-mapping or a duplicate key."""
        if not isinstance(self.node, yaml.MappingNode):
            self.fail(f"{what}: expected a mapping (key: value), got {self.kind_name}")
        out: dict[str, Node] = {}
        for key_node, value_node in self.node.value:
            key = self._wrap(key_node).scalar(f"{what} key")
            if isinstance(key, bool) and isinstance(key_node, yaml.ScalarNode) and key_node.style is None:
                key = str(key_node.value)   # YAML 1.1 reads a bare `on:` (yes, off, ...) as a bool: a name here
            if not isinstance(key, str):
                self._wrap(key_node).fail(f"{what}: keys must be names, got {key!r}")
            if key in out:
                self._wrap(key_node).fail(f"{what}: duplicate key {key!r}")
            out[key] = self._wrap(value_node)
        return out

    def sequence(self, what: str) -> list[Node]:
        if not isinstance(self.node, yaml.SequenceNode):
            self.fail(f"{what}: expected a list (- item), got {self.kind_name}")
        return [self._wrap(n) for n in self.node.value]

    def scalar(self, what: str) -> Any:
        if not isinstance(self.node, yaml.ScalarNode):
            self.fail(f"{what}: expected a single value, got {self.kind_name}")
        return self._loader.construct_object(self.node, deep=True)

    def value(self) -> Any:
        """The plain Python value (any shape)."""
        return self._loader.construct_object(self.node, deep=True)

    @property
    def kind_name(self) -> str:
        if isinstance(self.node, yaml.MappingNode):
            return "a mapping"
        if isinstance(self.node, yaml.SequenceNode):
            return "a list"
        return f"{self._loader.construct_object(self.node)!r}"

    # Typed accessors: each says what it expected.
    def string(self, what: str) -> str:
        v = self.scalar(what)
        if not isinstance(v, str) or not v:
            self.fail(f"{what}: expected a non-empty string, got {v!r}")
        return v

    def _numeric(self, what: str, expected: str) -> int | float:
        v = self.scalar(what)
        if isinstance(v, str) and self.node.style is None and _FLOAT_12.fullmatch(v):
            v = float(v)     # 1e12: a number in YAML 1.2, a string to PyYAML
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.fail(f"{what}: expected {expected}, got {v!r}")
        return v

    def number(self, what: str, bound: Bound | None = None) -> float:
        """A finite number within `bound` (ints and floats alike)."""
        v = self._numeric(what, "a number")
        self.check(what, v, bound if bound is not None else Bound())
        return float(v)

    def integer(self, what: str, bound: Bound | None = None) -> int:
        """A whole number within `bound`; a float (2.0, 1e12) is refused: it is not a count."""
        v = self._numeric(what, "a whole number")
        self.check(what, v, replace(bound if bound is not None else Bound(), whole=True))
        return int(v)

    def boolean(self, what: str) -> bool:
        v = self.scalar(what)
        if not isinstance(v, bool):
            self.fail(f"{what}: expected true or false, got {v!r}")
        return v

    def duration(self, what: str, bound: Bound | None = None) -> float:
        """Seconds from 15s, 500ms, 1m30s or a number, within `bound` (its limits in seconds)."""
        try:
            seconds = parse_duration(self.scalar(what))
        except ValueError as exc:
            self.fail(f"{what}: {exc}")
        if bound is not None:
            self.check(what, seconds, replace(bound, duration=True))
        return seconds

    def strings(self, what: str) -> tuple[str, ...]:
        if isinstance(self.node, yaml.ScalarNode):
            return (self.string(what),)
        return tuple(n.string(what) for n in self.sequence(what))


def compose(text: str, file: str) -> Node:
    """Parse `text` into a located node tree; YAML syntax errors become ScenarioErrors with a line."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark else None
        raise ScenarioError(f"not valid YAML: {exc.problem}", file, line) from exc
    except yaml.YAMLError as exc:
        raise ScenarioError(f"not valid YAML: {exc}", file) from exc
    if node is None:
        raise ScenarioError("the file is empty; expected a scenario mapping (name, target, traffic, phases)",
                            file, 1)
    return Node(node, file, loader)
