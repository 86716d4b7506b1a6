"""What differs between the PyTorch releases Mesa supports (torch >= 2.8, see pyproject.toml),
detected by whether the feature exists, in this one place.

* :func:`current_graph_task_id`: the id of the backward pass the autograd engine runs on this
  thread, -1 outside one (``torch._C._current_graph_task_id``; -1 always where absent, and the
  backward workspace then stays unused).
* :func:`current_autograd_node`: the autograd node the engine runs on this thread, None outside a
  backward (``torch._C._current_autograd_node``; None always where absent: a reentrant
  checkpoint's recompute is then not told apart).
* :func:`is_dynamo_compiling`: whether torch.compile's dynamo traces (one Python call in eager
  mode; ``torch.compiler.is_compiling`` where the stricter function is absent).
* :func:`aten_call`: the C callable of an aten overload (``OpOverload._op``), called without
  the overload's Python ``__call__``; the overload itself where absent.
* :data:`SAVES_TO_SLOT`: whether ``ctx.save_for_backward(*t)`` is ``ctx.to_save = t`` (a
  custom Function's forward may then set the slot itself, without the method's Python frame;
  checked by running a Function that does so once, at import).
* :data:`C10D_WORLD`: torch.distributed's registry of process groups, whose ``_default_pg`` says
  without a call whether a default group exists (None where absent: ``dist.is_initialized()``).

Differences that need no switch are written once for all releases where they occur: a packed
copy is attached to a view of a custom Function's output while torch.compile traces
(:func:`mesa_ops.saved.attach_saved`; dynamo of torch 2.8 sets no attribute on the output
itself), it reaches the consuming layer's Function as an argument (``saved_record``), and
NamedTuples are built field by field (dynamo of torch 2.8 traces no ``_replace``). The CUDA
build checks that nvcc and torch share a CUDA major (:func:`mesa_ops.backend.toolkit_mismatch`).
"""
from __future__ import annotations

import torch

current_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)
current_autograd_node = getattr(torch._C, "_current_autograd_node", lambda: None)


def _c10d_world():
    try:
        from torch.distributed import distributed_c10d
    except ImportError:  # (a torch built without torch.distributed)
        return None
    world = getattr(distributed_c10d, "_world", None)
    return world if world is not None and hasattr(world, "_default_pg") else None


# torch.distributed's process-group registry, whose ``_default_pg`` is None until a default group
# is initialized: read once per stored activation without the three Python calls of
# dist.is_initialized(). None where this torch has no such attribute (then ask dist itself).
C10D_WORLD = _c10d_world()



# True while torch.compile's dynamo traces the calling code (dynamo answers it as a constant),
# False in eager mode: torch.compiler.is_dynamo_compiling (one Python call; is_compiling makes
# two, and a Mesa layer asks once per call), or is_compiling where this torch has no such function
is_dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", None) or torch.compiler.is_compiling


def _saves_to_slot() -> bool:
    """Whether a custom Function may save its tensors by ``ctx.to_save = tensors``: torch's own
    ``FunctionCtx.save_for_backward`` sets no other attribute, and a backward reads them back."""
    from torch.autograd.function import FunctionCtx

    class Probe:  # (FunctionCtx's method on a plain object: which attributes it sets)
        pass

    p, t = Probe(), torch.zeros(1)
    try:
        FunctionCtx.save_for_backward(p, t)
    except (TypeError, AttributeError):  # (another signature or a slot-less context)
        return False
    if set(vars(p)) != {"to_save"} or len(p.to_save) != 1 or p.to_save[0] is not t:
        return False

    class Direct(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.to_save = (x,)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * x

    try:  # (imported inside inference_mode or no_grad: grad recording on for the probe alone)
        with torch.inference_mode(False), torch.enable_grad():
            x = torch.full((1,), 3.0, requires_grad=True)
            Direct.apply(x).sum().backward()
    except RuntimeError:  # (an autograd that refuses it: use the method)
        return False
    return x.grad is not None and float(x.grad) == 3.0


# ctx.save_for_backward(*t) is ctx.to_save = t on this torch (a Mesa forward sets the slot in
# eager mode; dynamo follows the method only)
SAVES_TO_SLOT = _saves_to_slot()


def aten_call(overload):
    """The C callable behind an aten overload (``torch.ops.aten.X.default``): the same op
    without ``OpOverload.__call__``'s Python frame (a Mesa backward calls a few per layer in
    eager mode; while torch.compile traces, the overload itself). The overload where this torch
    keeps no such callable."""
    return getattr(overload, "_op", overload)


__all__ = ["current_graph_task_id", "current_autograd_node", "C10D_WORLD", "SAVES_TO_SLOT", "aten_call", "is_dynamo_compiling"]
