"""What autocast would do to an op, so Mesa's Functions compute exactly as the plain layer.

Mesa's autograd Functions run with autocast disabled and cast explicitly to the dtype that
autocast would have used; that dtype is read off the op itself on a tiny probe (cached), so the
CPU and CUDA autocast lists need not be copied here.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

_PROBES = {
    "linear": lambda x: F.linear(x, torch.ones(2, 2, dtype=torch.float32, device=x.device)),
    "matmul": lambda x: torch.matmul(x, torch.ones(2, 2, dtype=torch.float32, device=x.device)),
    "conv2d": lambda x: F.conv2d(x.view(1, 1, 2, 2), torch.ones(1, 1, 1, 1, device=x.device)),
    "layer_norm": lambda x: F.layer_norm(x, (2,)),
    "softmax": lambda x: F.softmax(x, dim=-1),
    "gelu": lambda x: F.gelu(x),
    "batch_norm": lambda x: F.batch_norm(x, None, None, training=True),
    "relu": lambda x: F.relu(x),
}


@functools.lru_cache(maxsize=None)
def _probe(op: str, device_type: str, amp_dtype: torch.dtype, in_dtype: torch.dtype) -> torch.dtype:
    x = torch.ones(2, 2, dtype=in_dtype, device=device_type)
    with torch.no_grad(), torch.autocast(device_type, dtype=amp_dtype):
        return _PROBES[op](x).dtype


# autocast_dtype(op, device type, autocast dtype, input dtype): the dtype ``op`` computes in
# under autocast (cached: a layer reads it without a Python frame)
autocast_dtype = _probe


def compute_dtype(op: str, x: torch.Tensor) -> torch.dtype:
    """The dtype ``op`` computes in for input ``x`` under the current autocast state."""
    dev = x.device.type
    if not x.is_floating_point() or not torch.is_autocast_enabled(dev):
        return x.dtype
    return _probe(op, dev, torch.get_autocast_dtype(dev), x.dtype)


def no_autocast(x: torch.Tensor):
    """Context that disables autocast on ``x``'s device (Functions cast by hand inside it); a
    no-op context when autocast is off (entering torch.autocast costs a few microseconds)."""
    dev = x.device.type
    if not torch.is_autocast_enabled(dev):
        return contextlib.nullcontext()
    return torch.autocast(dev, enabled=False)


def fp16_autocast(x: torch.Tensor) -> bool:
    """True under float16 autocast on ``x``'s device (where GradScaler skips non-finite steps)."""
    dev = x.device.type
    return torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) == torch.float16


def apply_without_autocast(dev: str, traced: bool, fn, *args):
    """``fn(*args)`` (a Function's apply) with autocast off on device type ``dev``, where it is
    on: in eager mode two C calls (torch.autocast's context manager costs three Python calls per
    layer); while torch.compile traces (``traced``) torch.autocast itself, which dynamo follows."""
    if traced:
        with torch.autocast(dev, enabled=False):
            return fn(*args)
    torch.set_autocast_enabled(dev, False)
    try:
        return fn(*args)
    finally:
        torch.set_autocast_enabled(dev, True)


# float32 and wider: used as they are where narrower dtypes are widened to float32 first (a
# LayerNorm's x-hat, the Linear's affine fold) or take another path (the bias-gradient sum)
WIDE_DTYPES = (torch.float32, torch.float64)


def as_dtype(t, dtype):
    """``t`` in ``dtype``: ``t`` itself when it already is (no dispatched ``to`` on the hot
    path); None stays None."""
    return t if t is None or t.dtype == dtype else t.to(dtype)
