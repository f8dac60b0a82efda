"""A stand-in for torchvision, named as such: importable names, objects that refuse to be used.

SGLang's model configs import torchvision's image transforms at module level, on the path to its host
memory pools; PyPI has no torchvision build that loads beside the CPU build of torch (its operators do not
register). Nothing these tests run transforms an image: every name resolves to an object that raises when
called. transformers is told torchvision is absent, so it never takes the stand-in for the real one.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any


class Unusable:
    """What any torchvision name is here: it may be imported, subclassed in a signature, never used."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name} is the test environment's torchvision stand-in; torchvision is not "
                           f"installed here")

    def __getattr__(self, item: str) -> Unusable:
        return Unusable(f"{self._name}.{item}")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


class _StandInModule(types.ModuleType):
    def __getattr__(self, item: str) -> Unusable:
        if item.startswith("__"):
            raise AttributeError(item)
        return Unusable(f"{self.__name__}.{item}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _StandInModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []


def install() -> None:
    """Put the stand-in in front of the import system (once), and tell transformers torchvision is absent."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    import transformers.utils as transformers_utils
    from transformers.utils import import_utils

    def absent() -> bool:
        return False

    import_utils.is_torchvision_available = absent
    transformers_utils.is_torchvision_available = absent
