"""A registry is a named table of small functions: ``ADVANTAGES.get("grpo")`` instead of an ``if`` ladder.

Built-ins are declared in :mod:`.catalog` by name and place (``"module:function"``) and imported on first use, so
knowing the names (a config check, ``--help``) costs no torch. Plugins need no edit here: a package names its
function in the registry's entry-point group, and the name is known (and accepted by the run config) as soon as
the package is installed, e.g. in the plugin's ``pyproject.toml``::

    [project.entry-points."streamrft.advantages"]
    my_baseline = "my_package.algorithms:my_baseline"
"""
from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterator, Mapping
from importlib.metadata import entry_points
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Functions of one kind (advantages, policy losses, ...) by name: built-ins from ``builtins``
    (name -> ``"module:function"``, imported when first asked for), plugins from entry-point ``group``, and
    functions added with :meth:`register`."""

    def __init__(self, kind: str, group: str | None = None, builtins: Mapping[str, str] | None = None) -> None:
        self.kind = kind
        self.group = group
        self._builtins = dict(builtins or {})
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def add(fn: F) -> F:
            if name in self._entries or name in self._builtins:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = fn
            return fn

        return add

    def get(self, name: str) -> F:
        """The function registered as ``name``, importing a built-in's or a plugin's module on first use (an
        import error in a plugin propagates: the caller reports it)."""
        if name not in self._entries:
            self._entries[name] = self._load(name)
        return self._entries[name]

    def names(self) -> list[str]:
        """Built-in and installed plugin names, importing no function."""
        return sorted(set(self._entries) | set(self._builtins) | {plugin.name for plugin in self._plugins()})

    def choices(self) -> str:
        """The sentence an error about an unknown name ends with: what is known, and where plugins come from."""
        where = f" (plugins register under the entry-point group {self.group!r})" if self.group else ""
        return f"known: {', '.join(self.names())}{where}"

    def _load(self, name: str) -> F:
        if name in self._builtins:
            module, _, attribute = self._builtins[name].partition(":")
            return getattr(importlib.import_module(module), attribute)
        plugin = next(iter(self._plugins(name)), None)
        if plugin is None:
            raise KeyError(f"unknown {self.kind} {name!r}; {self.choices()}")
        logger.info("loading %s plugin %r from %s", self.kind, name, plugin.value)
        return plugin.load()

    def _plugins(self, name: str | None = None):
        if self.group is None:
            return ()
        return entry_points(group=self.group) if name is None else entry_points(group=self.group, name=name)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._entries or name in self._builtins
                                          or any(True for _ in self._plugins(name)))

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
