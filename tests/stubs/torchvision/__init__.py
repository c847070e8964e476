"""Test-only stand-in for torchvision, used only by the SGLang venv (tests/test_sglang*.py).

Why: torchvision wheels need CUDA torch (their ``_C.so`` links ``libtorch_cuda.so``), the SGLang
venv holds CPU torch 2.13.0, and ``sglang.srt.configs`` imports ``torchvision.transforms`` at
module level for multimodal preprocessing that HiCache's storage code never runs. Every
``torchvision.*`` submodule resolves to a module whose attributes are inert placeholders;
calling one raises, so any real use fails loudly instead of computing nonsense.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.0.0+kvtier.stub"
__path__: list[str] = []


class _Placeholder:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("torchvision is a test stub in the kvtier SGLang venv")

    def __getattr__(self, name: str) -> _Placeholder:
        return _Placeholder()


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()


class _StubFinder:
    """Meta-path finder that answers every ``torchvision.<sub>`` import with a _StubModule."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


sys.meta_path.insert(0, _StubFinder())
