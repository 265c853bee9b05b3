"""A small name -> object registry that refuses duplicates and lists what exists.

It is also the one way a stage dispatches to its back ends (extract, regenerate, evaluate): each family's
package registers one small function per back end that imports the back-end module only when called, so
that vLLM is imported only where it is used, and adding a back end touches one module plus one entry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to objects of one kind (built-in verifiers, built-in data sets, ...).

    Args:
        kind: What the registry holds, used in error messages ("built-in verifier").
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str, item: T) -> T:
        """Adds ``item`` under ``name``; a second registration of the same name is a bug."""
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = item
        return item

    def entry(self, name: str) -> Callable[[T], T]:
        """A decorator form of :meth:`register`: ``@BACKENDS.entry("hf")`` above the function it registers."""

        def add(item: T) -> T:
            return self.register(name, item)

        return add

    def get(self, name: str) -> T:
        """Returns the item, or raises KeyError naming every registered name."""
        try:
            return self._items[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._items)

    def items(self) -> list[tuple[str, T]]:
        """``(name, item)`` pairs in the order they were registered (an order that means something: the
        pipeline's stages, the sections of params.yaml)."""
        return list(self._items.items())

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
