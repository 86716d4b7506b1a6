"""Saved-activation accounting: the bytes autograd holds for backward during a forward.

Counts every tensor that autograd saves (``torch.autograd.graph.saved_tensors_hooks``), by unique
storage, excluding the storages of parameters (and of any tensor passed in ``exclude``), and
attributes each storage to the innermost module running when it was first saved, by class name.
A parameter's cast copy (autocast's low-precision weight, issue 35: ~10.8 of the 13.5 MiB a bf16
ViT-Ti seemed to save; a frozen one's too, as in LoRA fine-tuning) is counted apart, in
``weight_cast_bytes``.

    with SavedActivationMeter(model) as meter:
        loss = model(x).sum()
    meter.total_bytes, meter.by_type   # e.g. {'Linear': 1.2e6, 'GELU': 4.1e5, ...}
    meter.by_name                      # e.g. {'blocks.0.mlp.act': 4.1e5, ...}

Parameters may be DTensors (FSDP2's ``fully_shard``): their local shards are excluded, and so are
the unsharded parameters FSDP2 registers on a unit during its forward (read when the unit's
forward starts).

Under ``torch.compile`` run one step before measuring (the hooks must not be active while dynamo
traces, or it traces them too); the meter then counts what the compiled graph saves, all of it
attributed to the compiled module.
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn as nn
try:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without torch.distributed
    DTensor = FSDPModule = ()


def _storage_key(t: torch.Tensor):
    if isinstance(t, DTensor):  # an FSDP2 / tensor-parallel parameter: its local shard
        t = t.to_local()
    s = t.untyped_storage()
    return (t.device.type, t.device.index, s.data_ptr()), s.nbytes()


class SavedActivationMeter:
    """Context manager recording what autograd saves for backward inside it.

    Args:
        model: module(s) whose parameters and buffers are excluded and whose submodules are
            used to attribute bytes to layer types.
        exclude: extra tensors not to count (e.g. inputs you keep anyway).
        module_hooks: attribute bytes to the running modules by forward hooks (False: the model
            runs compiled -- its hooks would be traced or retrace it; all bytes then go to
            ``by_name`` / ``by_type`` ``"(no module)"``).
    """

    def __init__(self, model: nn.Module | None = None, exclude=(), module_hooks: bool = True):
        self.model = model
        self.module_hooks = module_hooks
        self._exclude = set()
        if model is not None:
            for p in list(model.parameters()) + list(model.buffers()):
                self._exclude.add(_storage_key(p)[0])
        for t in exclude:
            self._exclude.add(_storage_key(t)[0])
        self._seen: dict = {}
        self._casts: set = set()  # storages of parameters' cast copies (autocast's weight cache)
        self.by_type: dict[str, int] = defaultdict(int)
        self.by_name: dict[str, int] = defaultdict(int)  # by the module's qualified name
        self._names: dict = {}
        self._stack: list[str] = []
        self._name_stack: list[str] = []
        self._running: list[set] = []  # per running module: its parameters' storages
        self._floating: list[list] = []  # per running module: its floating-point parameters
        self._by_shape: dict = {}  # the model's floating-point parameters by shape
        if model is not None:
            for p in model.parameters():
                if p.is_floating_point() and not isinstance(p, DTensor):
                    self._by_shape.setdefault(tuple(p.shape), []).append(p)
        self._active: dict = defaultdict(int)
        self._handles = []
        self._hooks = None

    # module stack, for attribution
    def _pre(self, module, args):
        self._stack.append(type(module).__name__)
        self._name_stack.append(self._names.get(id(module), ""))
        # the parameters registered now, while the module runs: of an FSDP2 unit, the unsharded
        # ones all-gathered for its forward (freed after it: their addresses may hold
        # activations later), not activations
        params = module.parameters() if isinstance(module, FSDPModule) else module._parameters.values()
        keys = {_storage_key(p)[0] for p in params if p is not None and p.device.type != "meta"}
        self._running.append(keys)
        self._floating.append([p for p in module._parameters.values()
                               if p is not None and p.is_floating_point()])
        for k in keys:
            self._active[k] += 1

    def _post(self, module, args, out):
        if self._stack:
            self._stack.pop()
            self._name_stack.pop()
        if self._floating:
            self._floating.pop()
        if self._running:
            for k in self._running.pop():
                self._active[k] -= 1
                if not self._active[k]:
                    del self._active[k]

    def _param_cast(self, t: torch.Tensor) -> bool:
        """``t`` is a cast copy of a parameter (autocast's cached low-precision weight: its
        autograd node is a copy whose input is the parameter's gradient accumulator), or a view
        of one (a linear saves the cast weight transposed). A cast without an autograd node (a
        frozen parameter's, LoRA's base weights; one made inside a custom Function's forward, a
        Mesa Linear's, which keeps it for its backward as autocast does) is the cast of a
        parameter of a running module: same shape, same values (in the parameter's dtype too: a
        compiled graph may save a weight copied into another layout, e.g. inductor's conv weight)."""
        base = t if t._base is None else t._base
        fn = base.grad_fn
        if fn is None:
            if not base.is_floating_point():
                return False
            # a cast (another dtype) of a running module's parameter (an FSDP2 unit's unsharded
            # ones), or a copy of one of the model's in another layout (a compiled graph runs its
            # modules' hooks only at its top: inductor's conv weight)
            return (any(base.shape == p.shape and base.dtype != p.dtype and not isinstance(p, DTensor)
                        and base.device == p.device and torch.equal(base, p.detach().to(base.dtype))
                        for ps in self._floating for p in ps)
                    or any(base.dtype == p.dtype and base.stride() != p.stride() and base.device == p.device
                           and torch.equal(base, p.detach()) for p in self._by_shape.get(tuple(base.shape), ())))
        if type(fn).__name__ != "ToCopyBackward0":
            return False
        for nxt, _ in fn.next_functions:
            var = getattr(nxt, "variable", None)
            if var is not None and _storage_key(var)[0] in self._exclude:
                return True
        return False

    def _pack(self, t: torch.Tensor):
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta":
            key, nbytes = _storage_key(t)
            if key not in self._exclude and key not in self._active and key not in self._seen:
                self._seen[key] = nbytes
                if self._param_cast(t):
                    self._casts.add(key)
                else:
                    self.by_type[self._stack[-1] if self._stack else "(no module)"] += nbytes
                    self.by_name[self._name_stack[-1] if self._name_stack else "(no module)"] += nbytes
        return t

    @staticmethod
    def _unpack(t):
        return t

    def __enter__(self):
        if self.model is not None and self.module_hooks:
            self._names = {id(m): n for n, m in self.model.named_modules()}
            for m in self.model.modules():
                self._handles.append(m.register_forward_pre_hook(self._pre))
                self._handles.append(m.register_forward_hook(self._post))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.by_type = dict(self.by_type)
        self.by_name = dict(self.by_name)
        return False

    @property
    def total_bytes(self) -> int:
        """Bytes of the activations saved (parameters and their cast copies apart)."""
        return int(sum(v for k, v in self._seen.items() if k not in self._casts))

    @property
    def weight_cast_bytes(self) -> int:
        """Bytes of the parameters' cast copies saved for backward: under autocast, each weight's
        low-precision copy (kept once per forward by autocast's cache, whatever the batch); not
        activations, so not in :attr:`total_bytes` or :attr:`by_type`."""
        return int(sum(self._seen[k] for k in self._casts))


def saved_activation_bytes(model: nn.Module, *inputs, loss_fn=None, **kwargs) -> SavedActivationMeter:
    """Run ``model(*inputs, **kwargs)`` under a meter and return the meter (forward only; the
    graph is freed when the output goes out of scope)."""
    with SavedActivationMeter(model) as meter:
        out = model(*inputs, **kwargs)
        if loss_fn is not None:
            loss_fn(out)
    del out
    return meter
