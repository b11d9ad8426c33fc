"""A stand-in for ``torchvision`` so that ``import timm`` works where no torchvision build matches torch.

timm imports ``torchvision`` (transforms, ops) at load time but its model code, which is all the zoo
uses, never calls it. Every ``torchvision.*`` module is served as a placeholder whose attributes are
classes that raise when instantiated, so anything that does need torchvision fails loudly.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any


def _refuse(self: object, *args: Any, **kwargs: Any) -> None:
    raise RuntimeError(f"torchvision is not installed (tests/zoo stub): {type(self).__name__}")


class _Meta(type):
    def __getattr__(cls, name: str) -> str:
        if name.startswith("__"):
            raise AttributeError(name)
        return f"{cls.__name__}.{name}"


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        cls = _Meta(name, (), {"__init__": _refuse})
        setattr(self, name, cls)
        return cls


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install() -> None:
    """Serve ``torchvision`` from the stub (first on ``sys.meta_path``); idempotent.

    transformers asks once (and caches) whether torchvision is installed; it is asked here, before
    the stub appears, so that it keeps to its code paths without torchvision.
    """
    if importlib.util.find_spec("transformers") is not None:
        from transformers.utils.import_utils import is_torchvision_available

        is_torchvision_available()
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
