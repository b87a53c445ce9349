"""A name -> object registry that refuses duplicate names, and strict keyword calls.

Everything that params.yaml selects by name (advantage estimators, policy losses, KL
estimators, aggregation modes, KL controllers, training strategies, rollout engines, tasks,
reward functions) lives in one of these, so callers look a name up instead of writing
if/elif chains, and an unknown name fails with the list of allowed names. What an entry
needs (a critic, a greedy baseline, how its micro-batches are weighted) is declared on the
entry itself, never in a side table beside the registry.

Pure Python: the light config module lists the same names (``rlcore.names``) without
importing any registry, and a test keeps the two in sync.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Generic, Iterator, Mapping, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to objects; ``register`` refuses a name that is already taken."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, *names: str) -> Callable[[T], T]:
        """Decorator registering the object under each of ``names``."""

        def decorator(obj: T) -> T:
            for name in names:
                self.add(name, obj)
            return obj

        return decorator

    def add(self, name: str, obj: T) -> None:
        """Register ``obj`` under ``name``; a name already taken is refused."""
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = obj

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; allowed: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)


def keyword_names(fn: Callable[..., Any]) -> frozenset[str]:
    """The keyword parameters ``fn`` accepts (refusing ``**kwargs``: a registered function names
    every argument it takes, so an unexpected keyword is an error instead of being dropped)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        raise TypeError(f"{fn.__qualname__} takes **kwargs; registered functions name every argument")
    return frozenset(p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))


def check_keywords(what: str, given: Mapping[str, Any], accepted: frozenset[str]) -> None:
    """Raise TypeError naming the first keyword in ``given`` that ``what`` does not accept."""
    unexpected = sorted(set(given) - accepted)
    if unexpected:
        raise TypeError(f"{what} got unexpected keyword argument(s) {', '.join(map(repr, unexpected))}; "
                        f"it accepts: {', '.join(sorted(accepted))}")


def options_from(settings: Any, names: frozenset[str]) -> dict[str, Any]:
    """``{name: settings.name}`` for each of ``names``: the options an entry declares, read from a
    typed settings object. A name the settings object lacks raises AttributeError naming it."""
    missing = sorted(n for n in names if not hasattr(settings, n))
    if missing:
        raise AttributeError(f"{type(settings).__name__} has no field(s) {', '.join(missing)} "
                             "that the selected entry needs")
    return {n: getattr(settings, n) for n in sorted(names)}
