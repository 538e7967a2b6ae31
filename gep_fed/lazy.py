"""A package's public names, imported from their modules on first use (PEP 562), so that
importing one light submodule (a ledger, a key) does not load PyTorch or Flower."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_exports(package: str, namespace: dict, public: Mapping[str, str]) -> Callable:
    """The module ``__getattr__`` of ``package`` whose names ``public`` maps to the module
    each is defined in; a name is imported once, then kept in ``namespace``."""

    def __getattr__(name: str):
        if name not in public:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(public[name]), name)
        namespace[name] = value
        return value

    return __getattr__
