"""Coverage audit: what autograd saves for backward, per module, and whether Mesa packed it.

``mesa_ops.audit(model, example_inputs)`` runs one training forward under
``torch.autograd.graph.saved_tensors_hooks`` (through :class:`mesa_ops.SavedActivationMeter`:
unique storages, parameters and buffers excluded), attributes each saved tensor to the innermost
module running when it was saved (forward pre/post hooks keep a module stack), and prints per
module the saved tensors (shape, dtype), their bytes and whether they are compressed, with the
uncompressed remainder summed at the bottom. It also returns an :class:`AuditReport`.

"Compressed" means packed by Mesa's Quantizer (Pan et al., arXiv 2111.11124): the uint8 codes a
Mesa layer saves plus the per-group fp32 step/offset saved right after them, and the exact
prefix-token rows (class / distillation tokens, ``prefix_tokens``) a packed copy keeps. Everything else -
e.g. LayerNorm's fp32 mean/rstd, a dropout mask, the input of a layer Mesa has no counterpart
for - is "exact". Bytes are storage bytes (a saved view counts its whole storage, once).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from . import layers as L
from .attention_forms import MesaAttentionMixin
from .memory import SavedActivationMeter, _storage_key
from .quant import QuantMixin

__all__ = ["audit", "AuditReport", "ModuleRow", "SavedTensor", "format_bytes"]


def format_bytes(n: float) -> str:
    for unit, div in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


@dataclass
class SavedTensor:
    module: str          # qualified name of the innermost module ('' = the model itself)
    type: str            # its class name
    shape: tuple
    dtype: str
    bytes: int           # bytes of its storage (counted once per storage)
    compressed: bool


class _ByteSums:
    """Byte totals of ``self.tensors`` (saved-tensor rows with ``bytes`` and ``compressed``)."""

    @property
    def total_bytes(self) -> int:
        return sum(t.bytes for t in self.tensors)

    @property
    def packed_bytes(self) -> int:
        return sum(t.bytes for t in self.tensors if t.compressed)

    @property
    def exact_bytes(self) -> int:
        return self.total_bytes - self.packed_bytes


@dataclass
class ModuleRow(_ByteSums):
    name: str
    type: str
    is_mesa: bool
    tensors: list = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return self.total_bytes


@dataclass
class AuditReport(_ByteSums):
    """Per-module saved tensors of one training forward. ``modules`` in order of first save;
    ``reused``: (module, module that saved it first) for each storage a later module saved again
    (e.g. a Linear that keeps its LayerNorm's packed copy instead of one of its own)."""
    modules: list
    tensors: list
    reused: list = field(default_factory=list)

    def by_module(self) -> dict[str, int]:
        return {r.name: r.bytes for r in self.modules}

    def uncompressed(self) -> list:
        """Modules with exact (uncompressed) saved bytes, largest first."""
        return sorted((r for r in self.modules if r.exact_bytes), key=lambda r: -r.exact_bytes)

    def table(self, max_rows: int | None = None, max_tensors: int = 3) -> str:
        """The audit as text: one row per module, then the totals and the uncompressed rest."""
        rows = self.modules if max_rows is None else self.modules[:max_rows]
        w = max([len(r.name or "(model)") for r in rows] + [6])
        tw = max([len(r.type) for r in rows] + [4])
        out = [f"{'module':<{w}}  {'type':<{tw}}  {'bytes':>10}  {'compressed':<11}  saved for backward"]
        for r in rows:
            if r.packed_bytes == r.bytes:
                flag = "yes"
            elif r.packed_bytes == 0:
                flag = "NO"
            else:
                flag = f"{100 * r.packed_bytes / r.bytes:.0f}% packed"
            desc = ", ".join(f"{t.dtype}{list(t.shape)}" for t in r.tensors[:max_tensors])
            if len(r.tensors) > max_tensors:
                desc += f", +{len(r.tensors) - max_tensors} more"
            out.append(f"{r.name or '(model)':<{w}}  {r.type:<{tw}}  {format_bytes(r.bytes):>10}  "
                       f"{flag:<11}  {desc}")
        if max_rows is not None and len(self.modules) > max_rows:
            out.append(f"... {len(self.modules) - max_rows} more modules")
        total = self.total_bytes or 1
        unc = self.uncompressed()
        out.append(f"total saved for backward: {format_bytes(self.total_bytes)} in {len(self.tensors)} "
                   f"tensors; compressed (Mesa-packed): {format_bytes(self.packed_bytes)} "
                   f"({100 * self.packed_bytes / total:.1f}%)")
        out.append(f"uncompressed remainder: {format_bytes(self.exact_bytes)} "
                   f"({100 * self.exact_bytes / total:.1f}%) in {len(unc)} modules"
                   + (": largest " + ", ".join(f"{r.name or '(model)'} ({r.type}) "
                                               f"{format_bytes(r.exact_bytes)}" for r in unc[:5])
                      if unc else ""))
        return "\n".join(out)


class _AuditMeter(SavedActivationMeter):
    """SavedActivationMeter (its storage de-duplication and exclusions) keeping, per saved
    storage, the qualified name of the innermost module and whether Mesa packed it."""

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self._names = {id(m): n for n, m in model.named_modules()}
        self._mods: list = []
        self.saved: list = []
        self.reused: list = []  # (module, first saver) of each storage saved again by another module
        self._first: dict = {}  # storage key -> the module that saved it first
        self._meta_left: dict = {}  # module id -> step/shift tensors still expected after codes

    def _pre(self, module, args):
        super()._pre(module, args)
        self._mods.append(module)

    def _post(self, module, args, out):
        super()._post(module, args, out)
        if self._mods:
            self._mods.pop()

    def _owner(self):
        """The innermost module, and the Mesa layer it belongs to (a quantizer -> its layer)."""
        if not self._mods:
            return None, None
        inner = self._mods[-1]
        for m in reversed(self._mods):
            # (an attention form's own saves: the 1-bit mask of its explicit path's dropout)
            if isinstance(m, L.PACKING_LAYERS) or (m is inner and isinstance(m, MesaAttentionMixin)):
                return inner, m
            if not isinstance(m, QuantMixin):
                break
        return inner, None

    def _name(self, inner) -> str:
        if inner is None:
            return "(outside any module)"
        return self._names.get(id(inner), "(outside the model)")

    def _pack(self, t):
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta":
            key, nbytes = _storage_key(t)
            new = key not in self._exclude and key not in self._seen
            if not new and key in self._first:
                name = self._name(self._owner()[0])
                if name != self._first[key]:
                    self.reused.append((name, self._first[key]))
            if new:
                inner, mesa = self._owner()
                packed = False
                if mesa is not None:
                    if t.dtype == torch.uint8:
                        packed = True
                        self._meta_left[id(mesa)] = 2  # its step and shift follow
                    elif self._meta_left.get(id(mesa), 0) > 0 and t.dim() == 1:
                        packed = True
                        self._meta_left[id(mesa)] -= 1
                    elif getattr(t, "_mesa_head", False):  # exact prefix-token rows of a packed copy
                        packed = True
                    else:
                        self._meta_left[id(mesa)] = 0
                name = self._name(inner)
                self._first[key] = name
                self.saved.append(SavedTensor(name, type(inner).__name__ if inner is not None else "-",
                                              tuple(t.shape), str(t.dtype).replace("torch.", ""),
                                              nbytes, packed))
        return super()._pack(t)


def _as_tuple(example_inputs) -> tuple:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    raise TypeError(f"audit: example_inputs must be a tensor or a tuple of inputs, got "
                    f"{type(example_inputs).__name__}")


def audit(model: nn.Module, example_inputs, verbose=True, max_rows: int | None = None) -> AuditReport:
    """One training forward of ``model(*example_inputs)``: what autograd saves, per module.

    Args:
        model: any module (its train/eval mode is restored afterwards).
        example_inputs: a tensor or a tuple of positional inputs (e.g. (B, 3, H, W) images).
        verbose: True prints :meth:`AuditReport.table` with ``print``; a callable gets the text;
            False prints nothing.
    Returns:
        an :class:`AuditReport` (``modules``, ``tensors``, ``total_bytes``, ``packed_bytes``,
        ``exact_bytes``, ``uncompressed()``).
    """
    inputs = _as_tuple(example_inputs)
    was_training = model.training
    model.train()
    try:
        with _AuditMeter(model) as meter:
            out = model(*inputs)
        del out
    finally:
        model.train(was_training)
    mods = {n: m for n, m in model.named_modules()}
    rows: dict[str, ModuleRow] = {}
    for t in meter.saved:
        if t.module not in rows:
            m = mods.get(t.module)
            rows[t.module] = ModuleRow(t.module, t.type, isinstance(m, L.PACKING_LAYERS))
        rows[t.module].tensors.append(t)
    report = AuditReport(list(rows.values()), list(meter.saved), list(meter.reused))
    if verbose:
        (print if verbose is True else verbose)(report.table(max_rows))
    return report
