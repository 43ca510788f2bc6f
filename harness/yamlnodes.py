"""YAML nodes that know where they are: every error names the file, the line and what was expected.

`yaml.compose` keeps each node's start mark; values are built with the safe constructor, so
a scenario can never run code.
"""

from __future__ import annotations

from typing import Any, NoReturn

import yaml

from harness.durations import parse_duration
from harness.errors import ScenarioError


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

    def _wrap(self, node: yaml.Node) -> Node:
        return Node(node, self.file, self._loader)

    def mapping(self, what: str) -> dict[str, Node]:
        """The mapping's entries by key; fails on a non-mapping or a duplicate key."""
        if not isinstance(self.node, yaml.MappingNode):
            self.fail(f"{what}: expected a mapping (key: value), got {self.kind_name}")
        out: dict[str, Node] = {}
        for key_node, value_node in self.node.value:
            key = self._wrap(key_node).scalar(f"{what} key")
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

    def number(self, what: str, minimum: float | None = None, maximum: float | None = None) -> float:
        v = self.scalar(what)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.fail(f"{what}: expected a number, got {v!r}")
        if minimum is not None and v < minimum:
            self.fail(f"{what}: expected a number >= {minimum:g}, got {v!r}")
        if maximum is not None and v > maximum:
            self.fail(f"{what}: expected a number <= {maximum:g}, got {v!r}")
        return float(v)

    def integer(self, what: str, minimum: int | None = None) -> int:
        v = self.scalar(what)
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(f"{what}: expected a whole number, got {v!r}")
        if minimum is not None and v < minimum:
            self.fail(f"{what}: expected a whole number >= {minimum}, got {v!r}")
        return int(v)

    def boolean(self, what: str) -> bool:
        v = self.scalar(what)
        if not isinstance(v, bool):
            self.fail(f"{what}: expected true or false, got {v!r}")
        return v

    def duration(self, what: str) -> float:
        try:
            return parse_duration(self.scalar(what))
        except ValueError as exc:
            self.fail(f"{what}: {exc}")

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
