"""A registry of named scenarios for the multi-process workers: one function per scenario, filled by a decorator.

A worker script keeps one :class:`Scenarios` and registers each scenario where it is defined::

    SCENARIOS = Scenarios("worker.py")

    @SCENARIOS.register("features")
    def features(ctx: Context) -> dict: ...

    SCENARIOS.run("features", ctx)  # an unknown name raises ValueError naming the known ones

Names that come from a table (the parity cases) are added in a loop with :meth:`Scenarios.add`.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def settle() -> None:
    """Collect a finished scenario's garbage, then freeze what survives (modules imported lazily, caches), as a
    long-lived user process may do: the next scenario's collections (the strategy's GarbageCollection runs one at each
    fit's start) then scan only what that scenario made. Without it each fit's first collection rescanned every object
    of the earlier scenarios: 0.13 s per fit and rank, about 30 s of the suite's two largest launches."""
    gc.collect()
    gc.freeze()


class Scenarios:
    """Scenario name -> function. ``owner`` (the worker script) is named in the error for an unknown name."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._functions: dict[str, Callable[..., Any]] = {}

    def add(self, name: str, function: Callable[..., Any]) -> None:
        if name in self._functions:
            raise ValueError(f"{self.owner}: scenario {name!r} is registered twice")
        self._functions[name] = function

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: register the function under ``name``."""

        def decorate(function: F) -> F:
            self.add(name, function)
            return function

        return decorate

    def get(self, name: str) -> Callable[..., Any]:
        try:
            return self._functions[name]
        except KeyError:
            raise ValueError(
                f"{self.owner}: unknown scenario {name!r}; the known ones are {sorted(self._functions)}. "
                "Register a new one with the `register` decorator."
            ) from None

    def run(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Run scenario ``name``; then collect what it left and freeze the survivors (see :func:`settle`)."""
        try:
            return self.get(name)(*args, **kwargs)
        finally:
            settle()

    def check(self, names: Iterable[str]) -> None:
        """Raise ValueError before anything runs if one of ``names`` is unknown (on every rank alike)."""
        for name in names:
            self.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._functions

    def __iter__(self):
        return iter(self._functions)
