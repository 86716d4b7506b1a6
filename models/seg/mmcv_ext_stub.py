"""A stand-in for ``mmcv._ext``, the compiled operators of full mmcv, for mmcv-lite installs.

``mmseg.models`` imports ``mmcv.ops`` (``point_sample`` for the mask-classification heads), and
every module of ``mmcv.ops`` calls ``mmcv.utils.ext_loader.load_ext('_ext', [names])`` at import,
which imports ``mmcv._ext`` and checks the names exist. mmcv-lite ships no ``_ext``, so the import
fails although the models used here (PVT / Swin backbones, FPN, FPNHead, UPerHead, FCNHead,
cross-entropy) are pure PyTorch and never call a compiled op.

:func:`install` registers :class:`MissingCompiledOps` as ``mmcv._ext`` **only when no real
``mmcv._ext`` can be found** (full mmcv wins). Its attributes are functions that raise
``NotImplementedError`` naming the op, so a config that does need a compiled op (deformable
conv, CARAFE, SyncBN from ``mmcv.ops``, ...) fails with a clear message instead of silently.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

__all__ = ["MissingCompiledOps", "install", "is_stub_active"]

MODULE_NAME = "mmcv._ext"


class MissingCompiledOps(types.ModuleType):
    """Module object whose every public attribute is a function raising NotImplementedError."""

    is_mesa_stub = True

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def missing(*args, **kwargs):
            raise NotImplementedError(
                f"mmcv op {name!r} needs mmcv's compiled extension (mmcv._ext), which mmcv-lite does "
                "not have; install full mmcv (pip install mmcv, or mim install mmcv) to use it")

        missing.__name__ = name
        return missing


def is_stub_active() -> bool:
    """Whether ``mmcv._ext`` is this stub."""
    return getattr(sys.modules.get(MODULE_NAME), "is_mesa_stub", False)


def install() -> bool:
    """Register the stub as ``mmcv._ext`` if the compiled extension is missing. Returns whether
    the stub is active afterwards (False: full mmcv's ``_ext`` is there and is used)."""
    if MODULE_NAME in sys.modules:
        return is_stub_active()
    if importlib.util.find_spec(MODULE_NAME) is not None:
        return False
    stub = MissingCompiledOps(MODULE_NAME)
    # a spec without a loader: importlib and pkgutil see the module, and mmengine's
    # mmcv_full_available() (pkgutil.find_loader(...) is not None) still answers False
    stub.__spec__ = importlib.machinery.ModuleSpec(MODULE_NAME, loader=None)
    sys.modules[MODULE_NAME] = stub
    return True
