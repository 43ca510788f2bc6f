"""One shape for every table of implementations by name.

    SENDERS: Registry[str, SenderFactory] = Registry("sender", {"grpc": "replay.senders.grpc:GrpcSender"}, error=SenderError)
    SENDERS.add("h2", factory)            # or, on a class or function:  @SENDERS.register("h2")
    SENDERS.get("grpc")                   # the entry (a "module:attr" string is imported on first use)
    SENDERS.names()                       # ("grpc", "h2"): registration order, for --help and choices

Senders, capture backends, stream decoders, toxics, checks, fault appliers, limiters, model tiers,
arrival patterns, CPU contention methods and crash-cleanup steps are all Registries, so every place
that offers a choice (a click.Choice, a scenario's `choice:` parameter, a one-line error) reads the
names from the table instead of a copy of its keys. An unknown name raises the table's own error
class with one line: "unknown sender 'x'; expected one of: grpc, h2".
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")
E = TypeVar("E")


class UnknownName(LookupError):
    """The default error for a name a registry does not hold (a KeyError-like LookupError)."""


def _shown(key: Hashable) -> str:
    return ":".join(map(str, key)) if isinstance(key, tuple) else str(key)


class Registry(Generic[K, T]):
    """Entries by name (any hashable key), in registration order.

    what: the kind of entry, for errors ("sender"). entries: initial ones; a str value "module:attr" is
    imported when first asked for (keeps heavy modules such as bcc, scapy and grpcio off the import
    path). error: the exception class an unknown name raises (default UnknownName)."""

    def __init__(self, what: str, entries: Mapping[K, T | str] | None = None, *,
                 error: Callable[[str], Exception] = UnknownName) -> None:
        self.what = what
        self._error = error
        self._entries: dict[K, T | str] = dict(entries or {})

    def add(self, name: K, entry: T | str) -> None:
        """Register (or replace) `entry` under `name`."""
        self._entries[name] = entry

    def discard(self, name: K) -> None:
        """Remove `name` if registered (a test that added a fake entry takes it back)."""
        self._entries.pop(name, None)

    def register(self, *names: K) -> Callable[[E], E]:
        """Decorator: register the decorated class, function or instance under each of `names`."""
        def decorate(entry: E) -> E:
            for name in names:
                self._entries[name] = entry  # type: ignore[assignment]  # E is the registry's T
            return entry
        return decorate

    def get(self, name: K) -> T:
        """The entry registered as `name`; the registry's error (one line naming the choices) if none."""
        try:
            entry = self._entries[name]
        except (KeyError, TypeError):   # TypeError: an unhashable name from a hostile input
            raise self._error(f"unknown {self.what} {_shown(name)!r}; expected one of: "
                              f"{', '.join(_shown(n) for n in self._entries)}") from None
        if isinstance(entry, str):
            module, _, attr = entry.partition(":")
            entry = getattr(importlib.import_module(module), attr)
            self._entries[name] = entry
        return entry

    __getitem__ = get

    def find(self, name: K) -> T | None:
        """The entry registered as `name`, or None."""
        return self.get(name) if name in self else None

    def names(self) -> tuple[K, ...]:
        return tuple(self._entries)

    def items(self) -> Iterator[tuple[K, T]]:
        for name in tuple(self._entries):
            yield name, self.get(name)

    def __contains__(self, name: object) -> bool:
        try:
            return name in self._entries
        except TypeError:
            return False

    def __iter__(self) -> Iterator[K]:
        return iter(tuple(self._entries))

    def __len__(self) -> int:
        return len(self._entries)
