"""Lazy package attributes (PEP 562): a package maps public names to the module that defines them, and a name
imports its module on first use. Keeps ``import tl_steering`` (and the CLI's argument checks) free of torch's
heavy parts and TransformerLens."""

import importlib
from collections.abc import Callable
from typing import Any


def lazy_attributes(package: str, names: dict[str, str], namespace: dict[str, Any]
                    ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``names`` maps a public name to a relative module path; a
    name equal to its module's last part (``"errors": ".errors"``) is the module itself."""

    def __getattr__(name: str) -> Any:
        mod = names.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(mod, package)
        value = module if mod == "." + name else getattr(module, name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
