"""A name -> function registry that refuses duplicate names.

Everything that params.yaml selects by name (advantage estimators, policy losses,
KL penalties, reward functions, rollout engines) lives in one of these, so callers
look a name up instead of writing if/elif chains, and an unknown name fails with the
list of allowed names.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

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
                if name in self._items:
                    raise ValueError(f"{self.kind} {name!r} is already registered")
                self._items[name] = obj
            return obj

        return decorator

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
