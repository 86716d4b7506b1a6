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
* :data:`C10D_WORLD`: torch.distributed's registry of process groups, whose ``_default_pg`` says
  without a call whether a default group exists (None where absent: ``dist.is_initialized()``).

Differences that need no switch are written once for all releases where they occur: a packed
copy is attached to a view of a custom Function's output while torch.compile traces
(:func:`mesa_ops.packed.attach_saved`; dynamo of torch 2.8 sets no attribute on the output
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


def aten_call(overload):
    """The C callable behind an aten overload (``torch.ops.aten.X.default``): the same op
    without ``OpOverload.__call__``'s Python frame (a Mesa backward calls a few per layer in
    eager mode; while torch.compile traces, the overload itself). The overload where this torch
    keeps no such callable."""
    return getattr(overload, "_op", overload)


__all__ = ["current_graph_task_id", "current_autograd_node", "C10D_WORLD", "aten_call", "is_dynamo_compiling"]
