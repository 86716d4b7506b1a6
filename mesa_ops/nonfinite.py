"""Non-finite activations: reported at once on the CPU, checked without a host sync on the GPU.

A Mesa layer whose activation holds NaN or Inf leaves its running range as it is (the kernels
decide that on the device) and then, by its ``nonfinite`` mode, raises a FloatingPointError
naming the layer ('raise') or warns once and marks its stored copy non-finite ('skip'); see
:mod:`mesa_ops.quant`. On the CPU the kernel's flag is a host bool, so the report comes at once.
On CUDA reading the flag would cost a host-device synchronisation per stored activation (~100
per DeiT step), so each stored activation's per-group finite row stays on the device and is
checked later (:func:`defer`):

* at the end of every backward that ran a Mesa layer, the flags gathered since the previous check
  are copied to pinned host memory without blocking (one small copy and an event per step);
* at the end of a later backward, once that copy's event has completed (``Event.query()``, which
  does not block), they are read: the first layer whose activation was non-finite is reported,
  naming it, a step (or a few) after it happened -- the running ranges were never poisoned;
* :func:`check_nonfinite` (``ms.check_nonfinite()``) checks everything pending now, blocking (at
  the end of an epoch, or in tests).

Flags of fake tensors (fake-CUDA tests, tracing) hold no values and are dropped.
"""
from __future__ import annotations

import warnings

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["check_nonfinite", "defer", "must_report", "report"]

_WARNED: set = set()  # layer names already warned about non-finite activations
MAX_PENDING = 4096  # flags gathered before a check is started without waiting for a backward


def must_report(mode: str, name: str) -> bool:
    """Whether a non-finite activation of layer ``name`` must still raise or warn ('raise'
    always; 'skip' until the layer has warned once)."""
    return mode == "raise" or name not in _WARNED


def report(mode: str, name: str, shape, late: bool = False) -> None:
    """Raise ('raise') or warn once ('skip') about layer ``name``'s non-finite activation."""
    when = (" (found by the deferred GPU check after the step that produced it)" if late else "")
    if mode == "raise":
        raise FloatingPointError(
            f"{name}: the activation of shape {tuple(shape)} holds NaN or Inf{when}; it would "
            "poison the running range (set nonfinite='skip' to skip the range update on such "
            "steps and let the gradient become non-finite, as exact training would)")
    if name in _WARNED:
        return
    _WARNED.add(name)
    warnings.warn(f"{name}: the activation holds NaN or Inf (e.g. fp16 overflow){when}; its "
                  "running range is not updated on such steps and its stored copy is marked "
                  "non-finite, so the gradient is non-finite and GradScaler skips the step "
                  "(warned once)", RuntimeWarning, stacklevel=3)


class _Log:
    """Finite flags waiting to be read: ``pending`` (device tensors, this step's) and
    ``in_flight`` (copies to the host started, with the event that completes them)."""

    def __init__(self):
        self.pending: list = []  # (flags (G,), mode, layer (str or a module), shape)
        self.in_flight: list = []  # (host flags, event or None, entries)
        self.queued = False

    def add(self, flags, mode, layer, shape) -> None:
        if type(flags) is FakeTensor:
            return
        self.pending.append((flags, mode, layer, shape))
        if len(self.pending) >= MAX_PENDING:  # (no backward drained it: e.g. a compiled one)
            self.read(block=False)
            self.start()

    def start(self) -> None:
        """Start copying the pending flags to the host (no wait)."""
        entries, self.pending = self.pending, []
        if not entries:
            return
        flat = torch.cat([f.reshape(-1) for f, *_ in entries])
        if flat.is_cuda:
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = flat, None
        self.in_flight.append((host, event, entries))

    def read(self, block: bool) -> None:
        """Report from every started copy that has arrived (all of them, waiting, if ``block``)."""
        keep = []
        for item in self.in_flight:
            host, event, entries = item
            if event is not None and not event.query():
                if not block:
                    keep.append(item)
                    continue
                event.synchronize()
            self._scan(host, entries, late=event is not None)
        self.in_flight = keep

    def _scan(self, host, entries, late: bool) -> None:
        ok = host.tolist()
        i = 0
        for flags, mode, layer, shape in entries:
            n = flags.numel()
            if not all(ok[i:i + n]):
                name = layer if isinstance(layer, str) else layer.describe()
                if must_report(mode, name):
                    self.in_flight = []  # (reported: nothing older is left to read)
                    report(mode, name, shape, late=late)
            i += n

    def end_of_backward(self) -> None:
        self.queued = False
        self.read(block=False)
        self.start()


_LOG = LOG = _Log()  # (LOG: read by the Mesa backwards, which call on_backward only when it holds flags)


def defer(flags: torch.Tensor, mode: str, layer, shape) -> None:
    """Check later that every entry of the device tensor ``flags`` (a stored activation's
    per-group finite row) is 1, reporting ``layer`` (its name, or the module) by ``mode``."""
    if mode == "raise" or must_report(mode, layer if isinstance(layer, str) else layer.describe()):
        _LOG.add(flags, mode, layer, shape)


def on_backward() -> None:
    """Called by each Mesa backward: schedules the non-blocking check at the end of this
    backward when flags are pending or in flight (cheap when nothing is)."""
    if (_LOG.pending or _LOG.in_flight) and not _LOG.queued:
        torch.autograd.Variable._execution_engine.queue_callback(_LOG.end_of_backward)
        _LOG.queued = True


def check_nonfinite() -> None:
    """Check every deferred finite flag now (blocking: one host sync); raises or warns as the
    layers' ``nonfinite`` modes say. A no-op on the CPU, whose checks are never deferred."""
    _LOG.start()
    _LOG.read(block=True)
