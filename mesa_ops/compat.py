"""What differs between the PyTorch releases Mesa supports (torch >= 2.8, see pyproject.toml),
detected by whether the feature exists, in this one place.

* :func:`current_graph_task_id`: the id of the backward pass the autograd engine runs on this
  thread, -1 outside one (``torch._C._current_graph_task_id``; -1 always where absent, and the
  backward workspace then stays unused).
* :func:`current_autograd_node`: the autograd node the engine runs on this thread, None outside a
  backward (``torch._C._current_autograd_node``; None always where absent: a reentrant
  checkpoint's recompute is then not told apart).

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

__all__ = ["current_graph_task_id", "current_autograd_node"]
