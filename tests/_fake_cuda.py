"""Fake CUDA for tests on machines without a GPU.

Under ``torch._subclasses.fake_tensor.FakeTensorMode`` CUDA tensors exist without a GPU: every
aten op runs its meta function (shapes, dtypes, devices; no values), so the CUDA-only Python
branches of Mesa (SDPA's flash / memory-efficient / cuDNN calls, the fake kernels' signatures,
the deferred non-finite check) run on the CPU machines we test on. Three pieces are needed:

* :func:`to_fake_cuda`: a model built on the CPU, moved to fake CUDA (building it under the mode
  fails: initializers read values);
* :func:`cuda_available`: ``torch.autocast('cuda')`` (and Mesa's probe of what it computes in)
  refuses to turn on without a CUDA device; the autocast state itself is thread-local and
  works on fake CUDA tensors;
* :func:`backward`: since torch 2.11 the autograd engine asks the CUDA driver for a primary
  context of every CUDA device a graph touches, so ``loss.backward()`` cannot run on fake CUDA
  tensors without a GPU. :func:`backward` walks the graph itself: each node is called once, in a
  topological order, with the sum of the gradients flowing into it, each reduced to and cast
  to the input's metadata (the engine's ``validate_outputs``), in no-grad mode (as the engine
  runs a ``create_graph=False`` backward); ``AccumulateGrad`` nodes add into ``.grad``. As in the
  engine, Mesa sees a graph task while it runs (``packed._graph_task_id``: its backward workspace
  and the restored copies handed from one backward to the next, saved.Share, are used), and the
  workspace's end-of-backward callback runs when it ends; no other final callback runs (fake
  flags are never queued).

:class:`HostSyncCounter` counts the ops that make the host wait for the device
(``_local_scalar_dense`` behind ``.item()`` / ``bool()`` / ``float()``, and device-to-host copies).
"""
from __future__ import annotations

import contextlib
import functools
import subprocess
import sys

import torch
import torch._subclasses.fake_tensor as fake_tensor_mod
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


@contextlib.contextmanager
def fake_cuda():
    """A FakeTensorMode in which custom autograd Functions record which of their arguments were
    tensors (the engine passes only those gradients on; :func:`backward` needs to know)."""
    fn_cls = torch.autograd.Function
    original = fn_cls.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        out = original.__get__(None, cls)(*args, **kwargs)
        for o in out if isinstance(out, tuple) else (out,):
            node = getattr(o, "grad_fn", None)
            if node is not None and hasattr(node, "_forward_cls"):
                node._tensor_args = [isinstance(a, torch.Tensor) for a in args]
                break
        return out

    fn_cls.apply = classmethod(apply)
    # A new fake CUDA tensor "initialises the GPU context" (a real torch.empty on the device) where
    # its torch thinks a GPU is there: torch <= 2.13 asks torch.cuda.is_available(), which
    # cuda_available() below reports True. There is no GPU to initialise here.
    init_ctx = getattr(fake_tensor_mod, "init_gpu_context", None)
    if init_ctx is not None:
        fake_tensor_mod.init_gpu_context = lambda device: None
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            yield mode
    finally:
        fn_cls.apply = original
        if init_ctx is not None:
            fake_tensor_mod.init_gpu_context = init_ctx


@contextlib.contextmanager
def cuda_available():
    """``torch.cuda.is_available()`` (and bf16 support) reported True: autocast('cuda') and the
    code probing it turn on. Enter it after :func:`to_fake_cuda` (moving a module asks the
    driver when CUDA is said to be there)."""
    saved = torch.cuda.is_available, torch.cuda.is_bf16_supported
    torch.cuda.is_available = lambda: True
    torch.cuda.is_bf16_supported = lambda *a, **k: True
    try:
        yield
    finally:
        torch.cuda.is_available, torch.cuda.is_bf16_supported = saved


def to_fake_cuda(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` moved to fake CUDA (call inside the fake mode): parameters are replaced, not
    swapped (a fake tensor cannot take a real one's place in place)."""
    old = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        return module.to("cuda:0")  # (torch <= 2.8 asks the driver which device a bare "cuda" is)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(old)


_PROBE = """
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
with FakeTensorMode():
    x = torch.ones(2, device="cuda:0", requires_grad=True)
    (x * 2).sum()
print("ok")
"""


@functools.lru_cache(maxsize=None)
def autograd_unsupported() -> str | None:
    """None where this torch records autograd graphs of fake CUDA tensors, else why not. Up to
    torch 2.8 (at least) a leaf's gradient accumulator asks the CUDA driver for the current stream
    (``InputMetadata``) and the process aborts without a GPU: probed in a child process."""
    if torch.cuda.is_available():
        return None
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300)
    if proc.returncode == 0 and proc.stdout.strip().endswith("ok"):
        return None
    return (f"torch {torch.__version__} cannot record autograd on fake CUDA tensors without a GPU "
            f"(its InputMetadata asks the driver for a stream; the probe exited {proc.returncode})")


def _topological(root) -> list:
    order, seen, stack = [], set(), [(root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                stack.append((nxt, False))
    return order[::-1]  # every node before the nodes it feeds


_FAKE_TASK = 1 << 40  # the graph task id Mesa sees during backward() (the engine's count from 0)


@contextlib.contextmanager
def _graph_task():
    """What Mesa reads of the engine while :func:`backward` runs: a graph task id, and its
    workspace armed for this task (the engine would run its queued clear at the end: run here)."""
    from mesa_ops import packed

    ws = packed._workspace()
    ws.clear()
    ws.armed, ws.task = True, _FAKE_TASK  # (no callback queued: there is no engine to run it)
    saved = packed._graph_task_id
    packed._graph_task_id = lambda: _FAKE_TASK
    try:
        yield
    finally:
        packed._graph_task_id = saved
        ws.clear()


def backward(loss: torch.Tensor, grad: torch.Tensor | None = None) -> None:
    """``loss.backward(grad)`` without the autograd engine (see the module docstring)."""
    root = loss.grad_fn
    grads = {root: [torch.ones_like(loss) if grad is None else grad]}
    if not hasattr(root, "_input_metadata"):
        raise TypeError("backward: the loss has no autograd graph")
    with torch.no_grad(), _graph_task():
        for node in _topological(root):
            slots = grads.pop(node, None)
            if slots is None:
                continue
            if hasattr(node, "variable"):  # AccumulateGrad
                var, g = node.variable, slots[0]
                if g is not None:
                    var.grad = g if var.grad is None else var.grad + g
                continue
            n_in = len(node._input_metadata)
            slots = slots + [None] * (n_in - len(slots))
            if hasattr(node, "_forward_cls"):  # a custom Function: gradients of its tensor args
                outs = node.apply(*slots)
                outs = outs if isinstance(outs, tuple) else (outs,)
                outs = [g for g, is_t in zip(outs, node._tensor_args) if is_t]
            else:
                outs = node(*slots)
                outs = outs if isinstance(outs, tuple) else (outs,)
            for (nxt, nr), g in zip(node.next_functions, outs):
                if nxt is None or g is None:
                    continue
                meta = nxt._input_metadata[nr]  # as the engine's validate_outputs
                if tuple(g.shape) != tuple(meta.shape):
                    g = g.sum_to_size(meta.shape)
                if g.dtype != meta.dtype:
                    g = g.to(meta.dtype)
                box = grads.setdefault(nxt, [])
                box.extend([None] * (nr + 1 - len(box)))
                box[nr] = g if box[nr] is None else box[nr] + g


def _is_cuda(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cuda"


class HostSyncCounter(TorchDispatchMode):
    """Records every op that would block the host on a CUDA device: ``_local_scalar_dense``
    (``.item()``, ``bool(t)``, ``float(t)``, ``int(t)``) of a CUDA tensor, and copies from CUDA to
    the host (``.cpu()``, ``.tolist()``, ``.to('cpu')``, ``copy_`` into a CPU tensor)."""

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in (aten._local_scalar_dense, aten.item) and _is_cuda(args[0]):
            self.syncs.append(str(func))
        elif packet is aten._to_copy and _is_cuda(args[0]):
            dev = kwargs.get("device")
            if dev is not None and torch.device(dev).type == "cpu":
                self.syncs.append(str(func))
        elif packet is aten.copy_ and not _is_cuda(args[0]) and _is_cuda(args[1]):
            if not kwargs.get("non_blocking", len(args) > 2 and args[2]):
                self.syncs.append(str(func))
        return func(*args, **kwargs)


@contextlib.contextmanager
def counting_host_syncs():
    counter = HostSyncCounter()
    with counter:
        yield counter


# Mesa's kernels on fake CUDA are backend._FakeKernels' methods (shapes only); the launches each
# makes on a GPU (cuda/quant_cuda.cu; tests/test_cuda_emulation.py counts them on the emulated
# kernels): quantize_step = quantize_step_kernel, one cooperative launch (two, minmax_kernel +
# quantize_kernel, only on a device without cooperative launches or while a CUDA graph is
# captured); quantize_step_many = the same kernel for up to 3 tensors of one dtype (the q, k, v of
# an attention), dequantize_out_many = dequantize_many_kernel (tests/test_cuda_emulation.py
# checks both are one launch); restore = dequantize_kernel into a new tensor; group_minmax /
# range_update = minmax_kernel
MESA_KERNEL_LAUNCHES = {"quantize_step": 1, "quantize_step_many": 1, "dequantize_out_many": 1, "quantize": 1, "dequantize": 1, "dequantize_out": 1,
                        "restore": 1, "lut_apply_out": 1, "levels": 1, "group_minmax": 1, "range_update": 1}
_NO_LAUNCH = ("empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach",
              "_unsafe_view", "lift_fresh", "alias")  # allocations and aliases


class LaunchCounter(TorchDispatchMode):
    """Counts the kernel launches a step would make on a GPU: every aten op on CUDA tensors
    except views, aliases and allocations (one launch each: an estimate, some ops launch two),
    and Mesa's kernels by :data:`MESA_KERNEL_LAUNCHES` (:func:`counting_launches` wraps them).
    ``by_op``: launches per op name."""

    def __init__(self):
        super().__init__()
        self.by_op: dict[str, int] = {}
        self.depth = 0  # inside a Mesa kernel

    def add(self, name: str, n: int = 1) -> None:
        self.by_op[name] = self.by_op.get(name, 0) + n

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    @property
    def mesa(self) -> int:
        return sum(v for k, v in self.by_op.items() if k.startswith("mesa."))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if self.depth == 0 and not func.is_view and name not in _NO_LAUNCH:
            flat = out if isinstance(out, (tuple, list)) else (out,)
            if any(_is_cuda(t) for t in flat):  # (not .device / .size queries)
                self.add(name)
        return out


@contextlib.contextmanager
def counting_launches():
    """A :class:`LaunchCounter` active, Mesa's fake kernels counted too."""
    from mesa_ops import backend as be

    counter = LaunchCounter()
    saved = {}
    for name, n in MESA_KERNEL_LAUNCHES.items():
        fn = be._FakeKernels.__dict__.get(name)
        if fn is None:
            continue
        saved[name] = fn
        inner = fn.__func__ if isinstance(fn, staticmethod) else fn

        def wrapped(*a, _inner=inner, _name=name, _n=n, **k):
            if counter.depth == 0:  # (quantize_step calls quantize: one launch count)
                counter.add(f"mesa.{_name}", _n)
            counter.depth += 1
            try:
                return _inner(*a, **k)
            finally:
                counter.depth -= 1
        setattr(be._FakeKernels, name, staticmethod(wrapped))
    try:
        with counter:
            yield counter
    finally:
        for name, fn in saved.items():
            setattr(be._FakeKernels, name, fn)


class FlashLikeSDPA(torch.overrides.TorchFunctionMode):
    """``F.scaled_dot_product_attention`` of half-precision q, k, v without a mask run as the
    flash kernel, as a GPU would pick it (on fake CUDA PyTorch takes the math path: a dozen ops)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        F = torch.nn.functional
        if (func is F.scaled_dot_product_attention and kwargs.get("attn_mask") is None
                and len(args) == 3 and args[0].dtype in (torch.float16, torch.bfloat16)):
            q, k, v = args
            return aten._scaled_dot_product_flash_attention(
                q, k, v, kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False),
                scale=kwargs.get("scale"))[0]
        return func(*args, **kwargs)
