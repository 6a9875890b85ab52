"""Registries of callables that other layers or packages extend through entry points.

The core looks a name up here and never imports the module that provides it: the entry point is
imported on the callable's first call, or the first lookup of an attribute it carries
(``pyproject.toml`` declares the project's own)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping

__all__ = ["EntryPointRegistry"]


class EntryPointRegistry(MutableMapping):
    """name -> callable, registered in code or named by the entry points of ``group``.

    The entry points are listed on first use and each callable is imported only on its first call
    (or attribute lookup), so the core never imports the layers that extend it (one registered in
    code wins over an entry point of the same name)."""

    def __init__(self, group: str) -> None:
        self.group = group
        self._items: dict = {}
        self._listed = False

    def _list(self) -> dict:
        if not self._listed:
            self._listed = True
            from importlib.metadata import entry_points

            for ep in entry_points(group=self.group):
                self._items.setdefault(ep.name, _EntryPointCallable(ep))
        return self._items

    def __getitem__(self, name: str) -> Callable:
        return self._list()[name]

    def __setitem__(self, name: str, fn: Callable) -> None:
        self._items[name] = fn

    def __delitem__(self, name: str) -> None:
        del self._list()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._list()))

    def __len__(self) -> int:
        return len(self._list())


class _EntryPointCallable:
    """A callable named by an entry point, imported on its first call or on the first lookup of
    an attribute it carries."""

    def __init__(self, entry_point) -> None:
        self.entry_point = entry_point
        self._fn: Callable | None = None

    def _load(self) -> Callable:
        if self._fn is None:
            self._fn = self.entry_point.load()
        return self._fn

    def __call__(self, *args, **kwargs):
        return self._load()(*args, **kwargs)

    def __getattr__(self, name: str):
        # attributes the callable carries (e.g. a rerank contrast's ``regions``) read through;
        # private and dunder lookups (copy, pickle, IPython's display hooks) must not import it
        if name.startswith("_") or name == "entry_point":
            raise AttributeError(name)
        return getattr(self._load(), name)

    def __repr__(self) -> str:
        return f"<{self.entry_point.group} entry point {self.entry_point.value}>"
