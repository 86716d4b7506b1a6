"""Mesa's activation quantizer: groups, running range estimates, packing through the backend.

Paper (Pan et al., arXiv 2111.11124, Sec. 3): each activation saved for backward is stored as
b-bit codes with one scale and one offset per group; head-wise in attention (one group per head).
The range is learned by running estimates: on the first training step the batch's per-group
``min`` and ``max - min``; afterwards an EMA with decay ``ema_decay`` (0.9). Codes come from
stochastic (unbiased) rounding; values outside the running range are clamped to [0, 2^b - 1].

State kept in the state dict, with the original Mesa names: ``clip_val`` (G,) the range,
``shift`` (G,) the offset (running min), ``iteration`` (1,) the number of updates; and
``draws`` (1,) int64, on the CPU, the stochastic-rounding draws so far (a checkpoint without it,
e.g. the original's, resumes it from ``iteration``).

Group layout of a tensor (``quant_groups`` = G), by the layer kind (``group_dim``):
  * ``'last'`` (Linear, LayerNorm, GELU, ReLU): G contiguous groups along the last dim, whatever
    the rank: (B, C), (B, N, C) and channels-last tokens (B, H, W, C) group over C;
  * ``'channel'`` (Conv2d, BatchNorm2d, and the ``quant1``/``quant2`` of MatMul/Softmax): dim 1
    of 4-D and larger tensors -- (B, C, H, W) maps, (B, H, N, D) attention tensors (G = H is
    head-wise) -- else the last dim.

Non-finite activations (``nonfinite``): ``'raise'`` a FloatingPointError naming the layer;
``'skip'`` leave the running range as it is, mark the stored copy non-finite (so the gradient is
non-finite and a GradScaler skips the step, as in exact training) and warn once; ``'auto'`` (the
default) skips under fp16 autocast and raises otherwise. ``dist_sync`` (default True) all-reduces
the per-group min/max over the ranks of an initialized torch.distributed group before the EMA, so
every rank holds the same ``clip_val``/``shift``.

The packed copies the quantizer returns (:class:`~mesa_ops.packed.QTensor`) and how the layers'
autograd Functions store, share and restore them live in :mod:`mesa_ops.packed`.
"""
from __future__ import annotations

import itertools
import logging
import math
from typing import NamedTuple

import torch

from . import ops
from .amp import WIDE_DTYPES
from .compat import C10D_WORLD as _C10D_WORLD, current_autograd_node
from .backend import ENV as _ENV, BACKEND_VAR as _ENV_KEY, get_backend, kernel_for
from .draws import DrawStream
from .reference import RANGE_MODES
from .settings import (IGNORED_KEYS, KEYS, NONFINITE_MODES, SUPPORTED_BITS, PolicyError,
                       _index_list, _int, _META_KEYS, _nonneg_int, _tag_list, parse_groups)
from .packed import (CHANNELS_LAST, QTensor, _graph_task_id, _memory_view, _tnew, compiling, in_backward,
                     restorer)
# the storage helpers lived here before mesa_ops/packed.py: still importable from this module
from .packed import AffineQTensor, MappedQTensor, pack_mask, release  # noqa: F401
from .saved import attach_saved, find_saved, once_differentiable, save_for_backward, saved_tensors  # noqa: F401

_log = logging.getLogger("mesa_ops")
_RANGE_CODE = {m: i for i, m in enumerate(RANGE_MODES)}  # 'ema' 0, 'batch' 1, 'union' 2
# construction order of the quantizers of this process: the salt of an unnamed one (see salt_name)
_INSTANCES = itertools.count()
GROUP_DIMS = ("last", "channel")


def prefix_rows(shape, prefix: int) -> int:
    """How many leading rows along dim -2 a stored tensor of ``shape`` keeps exactly with
    ``prefix_tokens`` = ``prefix``: all of them for rank >= 3 and more rows than that, else 0."""
    return prefix if prefix and len(shape) >= 3 and shape[-2] > prefix else 0


def channel_dim(ndim: int) -> int:
    """The dim that ``'channel'`` groups split: 1 for 4-D and larger tensors, else the last."""
    return 1 if ndim >= 4 else ndim - 1


class QuantMixin(DrawStream):
    """Quantizer state and the one quantization path every Mesa layer stores activations through.

    ``prefix_tokens`` (default 0; the models set it, :func:`set_prefix_tokens`): the first rows
    along dim -2 of each stored tensor of rank >= 3 are kept exactly besides the packed copy.

    Attributes set by policy files and read by users (the original's names): ``enable``,
    ``level`` (2**bits), ``bits``, ``ema_decay``, ``quant_groups``, ``tag``, ``index``; plus
    ``stochastic`` (False: round to nearest), ``range_mode`` ('ema' or 'batch': exact per-batch
    min/max, for ablations), ``nonfinite`` ('auto' / 'raise' / 'skip', see the module doc;
    ``check_finite`` = True / False is the older spelling of 'raise' / 'skip'), ``group_size``
    (derive G from the group dim at run time), ``dist_sync`` (all-reduce the range statistics
    across ranks). ``group_dim`` ('last' or 'channel') is fixed by the layer kind.
    """

    group_dim = "channel"
    prefix_tokens = 0  # (class default: modules pickled whole before the setting existed)
    # Python-side settings (validated setters): TorchScript compiles a module's properties unless
    # listed here, and a scripted (eval-mode) Mesa layer is the plain layer, which reads none of them
    __jit_unused_properties__ = ["bits", "nonfinite", "check_finite", "level", "_draws"]

    def _init_quant(self, quant_groups=1, tag: str = "fm", enable: bool = False, bits: int = 8,
                    group_size: int | None = None):
        g = parse_groups(quant_groups)
        self.register_buffer("clip_val", torch.ones(g))
        self.register_buffer("shift", torch.zeros(g))
        self.register_buffer("iteration", torch.zeros(1))
        # stochastic-rounding draws so far, part of each seed (see ops.make_seed): a (1,) int64
        # buffer kept on the CPU, in the state dict so in-place loads (torch.distributed.checkpoint)
        # restore it; a checkpoint without it resumes it from ``iteration``
        self.register_buffer("draws", torch.zeros(1, dtype=torch.int64, device="cpu"))
        self._seen_iteration(self.iteration)
        self.enable = bool(enable)
        self.bits = bits
        self.ema_decay = 0.9
        self.quant_groups = g
        self.group_size = group_size
        self.tag = tag
        self.index = -1
        self.stochastic = True
        self.range_mode = "union"
        self.nonfinite = "auto"
        self.dist_sync = True
        self.prefix_tokens = 0
        self.layer_name = None
        self._instance = next(_INSTANCES)
        self.verbose = _log.info

    # ---- attributes -----------------------------------------------------------------------
    @property
    def bits(self) -> int:
        return self._bits

    @bits.setter
    def bits(self, value) -> None:
        b = int(value)
        if b not in SUPPORTED_BITS or b != value:
            raise ValueError(f"{self.describe()}: bits must be one of {SUPPORTED_BITS}, got {value!r}")
        self._bits = b

    @property
    def nonfinite(self) -> str:
        return self._nonfinite

    @nonfinite.setter
    def nonfinite(self, value) -> None:
        if value not in NONFINITE_MODES:
            raise ValueError(f"{self.describe()}: nonfinite must be one of {NONFINITE_MODES}, "
                             f"got {value!r}")
        self._nonfinite = value

    @property
    def check_finite(self) -> bool:
        """The older switch: True raises on NaN/Inf (nonfinite='raise'), False skips ('skip')."""
        return self._nonfinite != "skip"

    @check_finite.setter
    def check_finite(self, value) -> None:
        self.nonfinite = "raise" if value else "skip"

    @property
    def level(self) -> int:
        """Number of quantization levels, 2**bits (the original's attribute)."""
        return 1 << self._bits

    @level.setter
    def level(self, value) -> None:
        v = int(value)
        b = v.bit_length() - 1
        if v != value or (1 << b) != v or b not in SUPPORTED_BITS:
            raise ValueError(f"{self.describe()}: level must be 256, 16 or 4 (8, 4 or 2 bits), got {value!r}")
        self._bits = b

    def describe(self) -> str:
        name = getattr(self, "layer_name", None)
        where = f" '{name}'" if name else ""
        return (f"{type(self).__name__}{where} (tag={getattr(self, 'tag', '?')}, "
                f"index={getattr(self, 'index', -1)})")

    def extra_repr(self) -> str:
        base = super().extra_repr()
        q = (f"enable={self.enable}, bits={self.bits}, quant_groups={self.quant_groups}, "
             f"tag={self.tag}, index={self.index}")
        return f"{base}, {q}" if base else q

    def update_quantization_parameter(self, **parameters):
        """Apply one policy block (``by_index``, ``enable``, ``level``, ...) to this layer."""
        return update_quantization_parameter(self, **parameters)

    # ---- groups ---------------------------------------------------------------------------
    def groups_for(self, shape) -> tuple[int, int]:
        """(G, inner) of the (outer, G, inner) view for an activation of ``shape``."""
        nd = len(shape)
        if nd == 0:
            raise ValueError(f"{self.describe()}: cannot quantize a 0-d tensor")
        d = nd - 1 if self.group_dim == "last" else channel_dim(nd)
        c = shape[d]
        g = self.quant_groups
        if self.group_size:
            if c % self.group_size:
                raise ValueError(f"{self.describe()}: group_size={self.group_size} does not divide "
                                 f"the channel dim {c} (dim {d}) of input shape {tuple(shape)}")
            g = c // self.group_size
            if g != self.quant_groups:
                self._resize_groups(g)
        if c % g:
            raise ValueError(f"{self.describe()}: quant_groups={g} does not divide the group dim "
                             f"{c} (dim {d}, the {self.group_dim} dim) of input shape {tuple(shape)}")
        inner = (c // g) * math.prod(shape[d + 1:])
        return g, inner

    def _resize_groups(self, g: int) -> None:
        if float(self.iteration.reshape(-1)[0]) != 0:
            raise ValueError(f"{self.describe()}: input needs {g} groups but the running estimates "
                             f"hold {self.quant_groups}")
        dev = self.clip_val.device
        self.clip_val = torch.ones(g, device=dev)
        self.shift = torch.zeros(g, device=dev)
        self.quant_groups = g

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "clip_val"
        if self.group_size and key in state_dict and state_dict[key].shape != self.clip_val.shape:
            self._resize_groups(state_dict[key].numel())
        derive = prefix + "draws" not in state_dict and prefix + "iteration" in state_dict
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if derive:  # a checkpoint from before the counter was a buffer: it follows iteration
            if prefix + "draws" in missing_keys:
                missing_keys.remove(prefix + "draws")
            self._draws[0] = int(float(self.iteration.reshape(-1)[0]))
        self._seen_iteration(self.iteration)

    # ---- the quantization path ------------------------------------------------------------
    def _state_fp32(self) -> None:
        """Keep the running estimates in float32 (model.half() / .to(bf16) cast buffers too)."""
        for n in ("clip_val", "shift", "iteration"):
            t = getattr(self, n)
            if t.dtype != torch.float32:
                setattr(self, n, t.float())

    def _state(self):
        """(clip_val, shift, iteration), float32."""
        bufs = self._buffers
        clip, shift, it = bufs["clip_val"], bufs["shift"], bufs["iteration"]
        if not (clip.dtype == shift.dtype == it.dtype == torch.float32):
            self._state_fp32()
            clip, shift, it = bufs["clip_val"], bufs["shift"], bufs["iteration"]
        return clip, shift, it

    def _nonfinite_mode(self, amp16: bool) -> str:
        if self._nonfinite == "auto":
            return "skip" if amp16 else "raise"
        return self._nonfinite

    def quantize(self, x: torch.Tensor, amp16: bool = False,
                 norm: tuple[torch.Tensor, torch.Tensor] | None = None,
                 traced: bool | None = None) -> QTensor:
        """Update the running range from ``x`` and return its packed copy (training only).
        ``amp16``: the layer runs under fp16 autocast (``nonfinite='auto'`` then skips).
        ``norm`` = (mean, rstd), float32 with one value per row of the trailing dims they
        reduce (a LayerNorm's statistics, shaped (..., 1, ...)): store x-hat = (x - mean) * rstd
        in float32 instead of x (the CPU kernel normalizes while it reads x; elsewhere x-hat is
        computed first, with the same operations). ``traced``: whether torch.compile traces
        (None: asked here; a layer's Function passes what its forward already knows).

        In eager mode one kernel call does the range update, the codes and the exact prefix
        rows, its arguments decided once per input layout (:meth:`_step_call`); while
        torch.compile traces, or with a cross-rank range update, :meth:`_quantize_general`."""
        if torch.is_grad_enabled():  # (called outside a Function: no graph of its own)
            with torch.no_grad():
                return self.quantize(x, amp16, norm, traced)
        if not (compiling() if traced is None else traced):
            plan = self.__dict__.get("_qplan")
            native = None if plan is None else plan.native
            if native is not None:  # (the one native call: None where it does not apply)
                update = _graph_task_id() == -1 or _updates_range()
                if not (update and plan.sync and (_C10D_WORLD is None or _C10D_WORLD._default_pg is not None)
                        and ops.dist_world() > 1):
                    b = self._buffers
                    mix = 0 if not plan.stochastic else ops.SIGNED_MIX.get(plan.salt)
                    got = native(x, b["clip_val"], b["shift"], b["iteration"], b["draws"], update,
                                 ops.signed_salt_mix(plan.salt) if mix is None else mix,
                                 None if norm is None else norm[0], None if norm is None else norm[1], amp16,
                                 _ENV.get(_ENV_KEY))
                    if got is not None:
                        q, rows = got
                        if rows is not None:  # (a non-finite activation: the CPU's flag, or CUDA's rows)
                            ops.report_nonfinite(rows[3], None, plan.mode, self, x)
                        return q if q[9] is not None or not self.prefix_tokens else self._with_prefix(q, x, norm)
            call = self._step_call(x, amp16, norm)
            if call is not None:
                q = self._step_result(call[0].quantize_step(*call[1]), call[2])
                return q if q[9] is not None or not self.prefix_tokens else self._with_prefix(q, x, norm)
        return self._with_prefix(self._quantize_general(x, amp16, norm), x, norm)

    def _with_prefix(self, q: QTensor, x: torch.Tensor, norm) -> QTensor:
        """``q`` with the first ``prefix_tokens`` rows along dim -2 of what it stores (x, or
        x-hat with ``norm``) kept exactly as its ``head`` (:class:`~mesa_ops.packed.QTensor`),
        for tensors of rank >= 3 with more rows than that: the class / distillation tokens of
        (B, N, C) tokens and (B, H, N, D) heads, whose values a range shared with all tokens
        stores badly (issue 22.8). A ``q`` whose kernel wrote them already is returned as it is."""
        if q.head is not None or not self.prefix_tokens:
            return q
        p = prefix_rows(x.shape, self.prefix_tokens)
        if not p:
            return q
        head = x.narrow(-2, 0, p)
        if norm is not None:
            head = _normalized(head, tuple(s.narrow(-2, 0, p) if s.dim() >= 2 and s.shape[-2] == x.shape[-2]
                                           else s for s in norm))
        out = torch.empty(head.shape, dtype=q.dtype, device=head.device)  # (rows of its own)
        out.copy_(head)
        if not compiling():
            out._mesa_head = True  # (the audit counts it with the packed copy it belongs to)
        # (field by field: dynamo of torch 2.8 traces neither q._replace nor QTensor(*q[:-1], ...))
        return QTensor(q.packed, q.step, q.shift, q.shape, q.dtype, q.bits, q.groups, q.inner, q.transposed, out)

    def _layout(self, x: torch.Tensor, copy: bool):
        """(tensor to quantize, its layout code, G, inner): ``x`` itself or the memory-order view
        of a transposed (k^T) or channels-last 4-D ``x`` for channel groups (then the groups
        lie along the view's last dim: inner = C / G), see :func:`_memory_view`. May resize the
        state (group_size): read it after."""
        channel = self.group_dim == "channel"
        xs, layout = _memory_view(x, allow_transposed=channel, copy=copy, allow_channels_last=channel)
        if layout == CHANNELS_LAST:
            g = self.groups_for(x.shape)[0]
            return xs, layout, g, x.shape[1] // g
        return (xs, layout) + self.groups_for(xs.shape)

    def _fuses_norm(self, x: torch.Tensor, mean: torch.Tensor, inner: int) -> bool:
        """Whether the one-call kernel (the caller checks it is in use) can normalize ``x``
        rows while quantizing them: float32/16 or bfloat16 ``x`` read as it is (groups along
        the last dim) and statistics whose rows hold whole groups of ``inner`` elements."""
        if x.dtype not in _NORM_DTYPES or self.group_dim != "last":
            return False
        rows = mean.numel()
        if mean.dtype != torch.float32 or rows == 0 or x.numel() % rows or not mean.is_contiguous():
            return False
        # the statistics' rows must be x's leading dims (a LayerNorm's (..., 1, 1)): a batch
        # norm's (1, C, 1, 1) broadcast over the batch is normalized by torch first
        lead = list(mean.shape)
        while lead and lead[-1] == 1:
            lead.pop()
        if tuple(lead) != tuple(x.shape[:len(lead)]):
            return False
        return (x.numel() // rows) % inner == 0

    def _range_code(self) -> int:
        """The kernels' code of ``range_mode`` (reference.RANGE_MODES); a ValueError names a bad one."""
        code = _RANGE_CODE.get(self.range_mode)
        if code is None:
            raise ValueError(f"{self.describe()}: range_mode must be one of {RANGE_MODES}, "
                             f"got {self.range_mode!r}")
        return code

    def _step_plan(self, x: torch.Tensor, amp16: bool, norm, key) -> "_StepPlan":
        """What :meth:`_step_call` passes the kernel for inputs like ``x`` (the ``key``: layout,
        dtype, device, fp16 autocast, MESA_BACKEND, the row statistics' layout), decided once
        (:class:`_StepPlan`); where the kernel cannot apply ``norm`` (a batch norm's (1, C, 1, 1)
        statistics) the plan of x-hat, which torch computes first, as its ``xhat``. Kept in the
        layer's ``__dict__`` until an attribute of the layer is set to another value
        (:meth:`__setattr__`); a plan checks the state it was made for at each call (buffers
        moved or replaced: the general path, which makes a new one)."""
        be = kernel_for(get_backend(x), x, x.dtype, self._bits)
        sync = bool(self.dist_sync)
        if not getattr(be, "has_quantize_step", False):  # (the reference: the general path)
            plan = _StepPlan(key, None, None, 0, 0, 0, None, None, "", (), False, None, sync, None)
        else:
            range_code = self._range_code()
            self._state()  # (float32 running estimates)
            xs, transposed, g, inner = self._layout(x, copy=False)  # (may resize the state)
            if norm is not None and not (self._fuses_norm(xs, norm[0], inner) and norm[1].is_contiguous()):
                xn = _normalized(x, norm)  # (its layout follows from x's: the same for the same key)
                sub = self._step_plan(xn, amp16, None, (xn.shape, xn.stride(), xn.dtype, xn.device, amp16,
                                                        key[5], None))
                plan = _StepPlan(key, be, sub, 0, 0, 0, None, None, "", (), False, None, sync, None)
            else:
                p = 0 if transposed else prefix_rows(xs.shape, self.prefix_tokens)
                d = float(self.ema_decay)
                stochastic = bool(self.stochastic)
                # (the head's shape a tuple of ints: torch.empty parses it faster than a torch.Size)
                head_shape = tuple(xs.shape[:-2]) + (p, xs.shape[-1]) if p else None
                dtype, mode = x.dtype if norm is None else torch.float32, self._nonfinite_mode(amp16)
                native = getattr(be, "step_plan", None)
                if native is not None:  # (the same call in one native step: mesa::StepPlan)
                    native = native(x, amp16, None if norm is None else norm[0], None if norm is None else norm[1],
                                    key[5], transposed, g, inner, d, 1.0 - d, range_code, self._bits, stochastic,
                                    mode == "skip", list(head_shape or ()), dtype, QTensor, x.shape,
                                    self._buffers["iteration"], self._draws)
                plan = _StepPlan(key, be, None, transposed, g, inner, head_shape, dtype, mode,
                                 (d, 1.0 - d, range_code, self._bits), stochastic,
                                 self._salt() if stochastic else None, sync, native)
        self.__dict__["_qplan"] = plan
        return plan

    def __setattr__(self, name, value):
        # a setting set to another value may change what _step_plan decided (the same object:
        # nothing changes, as when compressed checkpointing re-applies a block's settings)
        if self.__dict__.get(name, _UNSET) is not value:
            self.__dict__.pop("_qplan", None)
        super().__setattr__(name, value)

    def __getstate__(self):
        # (torch.save of a whole model, copy.deepcopy): the step plan is decided again, and what
        # _it_seen holds (this quantizer's own buffers) is recorded again for the copy's buffers
        state = super().__getstate__()
        state.pop("_qplan", None)
        state.pop("_it_seen", None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        if "iteration" in self._buffers:  # (the draw counter and iteration come as they were)
            self._seen_iteration(self._buffers["iteration"])

    def _step_call(self, x: torch.Tensor, amp16: bool, norm):
        """(backend, the arguments of its one-call ``quantize_step`` for ``x``, what
        :meth:`_step_result` needs of them), or None where the general path applies (no such
        kernel, or a range update all-reduced across ranks). Runs once per stored activation:
        what depends only on the input's layout and the settings is decided once
        (:meth:`_step_plan`), the rest is read here without further Python calls."""
        key = (x.shape, x.stride(), x.dtype, x.device, amp16,
               _ENV.get(_ENV_KEY),
               None if norm is None else (norm[0].shape, norm[0].dtype, norm[0].stride(), norm[1].stride()))
        d = self.__dict__
        plan = d.get("_qplan")
        if plan is None or plan.key != key:
            plan = self._step_plan(x, amp16, norm, key)
        be = plan.be
        if be is None:
            return None
        # in a (non-reentrant) activation-checkpoint recomputation the running estimates were
        # already updated by this step's forward: quantize with them, do not update them twice;
        # a reentrant checkpoint's forward ran without grad (nothing quantized): its
        # recomputation is this step's forward and updates them
        update = _graph_task_id() == -1 or _updates_range()
        if update and plan.sync and (_C10D_WORLD is None or _C10D_WORLD._default_pg is not None) \
                and ops.dist_world() > 1:
            return None
        if plan.xhat is not None:  # x-hat first, by torch; then its own plan
            x, norm, plan = _normalized(x, norm), None, plan.xhat
        t = plan.transposed
        xs = x if not t else x.transpose(-2, -1) if t == 1 else x.permute(0, 2, 3, 1)
        bufs = self._buffers
        clip, shift, it, draws = bufs["clip_val"], bufs["shift"], bufs["iteration"], bufs["draws"]
        if not (clip.dtype is shift.dtype is it.dtype is _F32):
            clip, shift, it = self._state()
        seen = d.get("_it_seen")  # (_draws_for without a call where nothing changed)
        if not (seen is not None and seen[0] is it and seen[1] == it._version and seen[2] is draws
                and draws.is_cpu):
            draws = self._draws_for(it)
        head = None  # the exact prefix rows (_with_prefix), written by the kernel
        if plan.head_shape is not None:
            head = torch.empty(plan.head_shape, dtype=plan.dtype, device=x.device)
            head._mesa_head = True
        mix = 0
        if plan.stochastic:  # (the kernel hashes torch's generator state with the salt's mix)
            mix = ops.SIGNED_MIX.get(plan.salt)
            if mix is None:
                mix = ops.signed_salt_mix(plan.salt)
        args = (xs, plan.groups, plan.inner, clip, shift, it, *plan.consts, update, mix, draws,
                plan.stochastic, plan.mode == "skip", plan.stochastic,
                *((None, None) if norm is None else norm), head)
        return be, args, (x, it, draws, plan, x.shape, head)

    def _step_result(self, result, info) -> QTensor:
        """The QTensor of a :meth:`_step_call`'s kernel result (and its bookkeeping)."""
        packed, step, sh, finite, rows = result
        x, it, draws, plan, shape, head = info
        self.__dict__["_it_seen"] = (it, it._version, draws, draws._version)  # (_seen_iteration)
        if plan.native is not None:  # (and the native step's, which checks it before each call)
            plan.native.see(it, draws)
        if finite is not True:  # False (CPU), or None: only the device knows (CUDA)
            ops.report_nonfinite(rows[3], finite, plan.mode, self, x)  # (x as given: its shape named)
        return _tnew(QTensor, (packed, step, sh, shape, plan.dtype, plan.consts[3], plan.groups,
                               plan.inner, plan.transposed, head))

    def _quantize_general(self, x: torch.Tensor, amp16: bool, norm=None) -> QTensor:
        """Range update (all-reduced across ranks with ``dist_sync``) and quantization as two
        calls through :mod:`mesa_ops.ops`; while torch.compile traces, one native op
        (``mesa::quantize_step``) unless the range is all-reduced across several ranks."""
        range_code = self._range_code()
        mode = self._nonfinite_mode(amp16)
        d = float(self.ema_decay)
        bits = self._bits
        update = _updates_range()
        if norm is not None:
            x = _normalized(x, norm)
        name = self.describe()
        xs, transposed, g, inner = self._layout(x.detach(), copy=True)
        salt_name = self.salt_name()
        clip, shift, it = self._state()
        traced = compiling()
        draws = self._draws if traced else self._draws_for(it)
        if traced and not (self.dist_sync and ops.dist_world() > 1):  # (one native op: mesa::quantize_step;
            # the world as it is when dynamo traces)
            packed, params = ops.quantize_step(xs, g, inner, clip, shift, it, d, range_code, bits, update,
                                               draws, bool(self.stochastic), mode, name, salt_name)
            return QTensor(packed, params[1], params[2], x.shape, x.dtype, bits, g, inner, transposed)
        params = ops.range_update(xs, clip, shift, it, g, inner, d, range_code, bits,
                                  update, mode, name, bool(self.dist_sync))
        inv, step, sh = params[0], params[1], params[2]
        packed = ops.quantize(xs, inv, sh, draws, salt_name, bits, g, inner,
                              bool(self.stochastic), update)
        if not traced:
            self._seen_iteration(it)
        return QTensor(packed, step, sh, x.shape, x.dtype, bits, g, inner, transposed)


_NORM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# the autograd node the engine runs on this thread (None outside a backward)
_current_node = current_autograd_node
# the backward of torch.utils.checkpoint's reentrant checkpoint (use_reentrant=True; also timm's
# checkpoint_seq and torch.distributed's checkpoint_wrapper in REENTRANT mode): it recomputes
# the function (whose forward ran under no_grad) and then runs a nested backward through it
_REENTRANT_BACKWARD = "CheckpointFunctionBackward"


_UNSET = object()
_F32 = torch.float32


class _StepPlan(NamedTuple):
    """A quantizer's one-call kernel arguments for one input layout (:meth:`QuantMixin._step_plan`):
    ``be`` None where the general path applies; ``xhat`` the plan of x-hat where torch normalizes
    first; else the stored layout code, G, inner, the exact prefix rows' shape (or None), the
    stored dtype, the nonfinite mode, (decay, 1 - decay, range code, bits), rounding and the
    salt; ``sync``: the range statistics all-reduced across ranks (dist_sync); ``native``: the
    backend's native step for this layout (cuda/step_plan.h: it checks the layout and state and
    makes the same call, in one call from :meth:`QuantMixin.quantize`), or None."""
    key: tuple
    be: object
    xhat: "_StepPlan | None"
    transposed: int
    groups: int
    inner: int
    head_shape: tuple | None
    dtype: torch.dtype | None
    mode: str
    consts: tuple
    stochastic: bool
    salt: int | None
    sync: bool
    native: object  # the same call as one native step (mesa::StepPlan: the extension's), or None


def quantize_many(pairs, amp16: bool = False, traced: bool | None = None) -> list:
    """:meth:`QuantMixin.quantize` of each (quantizer, x) in ``pairs``, in order; the kernel calls
    of those that take the one-call path on one backend made together (on CUDA one launch for
    the q, k, v of an attention: ``quantize_step_many``; only where the first pair's backend has
    that op: else one call each). The results, states and draw counters
    are those of the calls one after the other (each quantizer has its own; where one raises,
    e.g. nonfinite='raise' on the CPU, the others' states may have moved already)."""
    traced = compiling() if traced is None else traced
    be0 = None
    if not traced and len(pairs) > 1:  # (kernel_for(get_backend(x), x, ...), cached: packed.restorer)
        x0 = pairs[0][1]
        be0 = restorer(x0, x0.dtype, pairs[0][0]._bits)
    if not getattr(be0, "has_many", False):  # (the CPU kernels: a call each, no bookkeeping)
        out = []
        for q, x in pairs:
            out.append(q.quantize(x, amp16, None, traced))
        return out
    with torch.no_grad():
        out = [None] * len(pairs)
        calls, infos = [], []
        for i, (q, x) in enumerate(pairs):
            call = q._step_call(x, amp16, None)
            if call is None or call[0] is not be0:
                out[i] = q.quantize(x, amp16, None, False)  # (the general path, or another backend)
                continue
            calls.append(call[1])
            infos.append((i, q, call[2]))
        results = (be0.quantize_step_many(calls) if len(calls) > 1
                   else [be0.quantize_step(*c) for c in calls])
        for (i, q, info), res in zip(infos, results):
            out[i] = q._with_prefix(q._step_result(res, info), pairs[i][1], None)
        return out


def _updates_range() -> bool:
    """Whether a quantization now updates the running range: in a forward; in a backward only
    in a reentrant checkpoint's recomputation (the forward it replays ran without grad, so no
    Mesa layer quantized in it), not in a non-reentrant one (the forward quantized already)."""
    if not in_backward():
        return True
    node = _current_node()
    return node is not None and type(node).__name__ == _REENTRANT_BACKWARD


def _normalized(x: torch.Tensor, norm) -> torch.Tensor:
    """x-hat = (x - mean) * rstd of ``norm`` = (mean, rstd), in float32 or wider (the
    operations of the kernel's row normalization)."""
    return torch.sub(x if x.dtype in WIDE_DTYPES else x.float(), norm[0]).mul_(norm[1])


class Quantizer(QuantMixin, torch.nn.Module):
    """A stand-alone quantizer module: the ``quant1`` / ``quant2`` of MatMul and Softmax."""

    def __init__(self, quant_groups=1, tag: str = "fm", enable: bool = False, bits: int = 8):
        torch.nn.Module.__init__(self)
        self._init_quant(quant_groups, tag=tag, enable=enable, bits=bits)


# ---- policy settings: application (values are validated by mesa_ops.settings) ------------
def _verbose(layer):
    v = layer.__dict__.get("verbose")
    if v is None and hasattr(layer, "quant1"):
        v = layer.quant1.__dict__.get("verbose")
    return v if callable(v) else _log.info


def _apply(target, layer, parameters) -> None:
    """Set the policy keys of ``parameters`` on ``target`` (the layer or one of its quantizers)."""
    for key, value in parameters.items():
        if key in _META_KEYS or key in IGNORED_KEYS:
            continue
        if key not in KEYS:
            raise PolicyError(f"{layer.describe()}: unknown policy key {key!r}; expected one of "
                              f"{', '.join(KEYS)}")
        try:
            value = KEYS[key](value)
        except ValueError as exc:
            raise PolicyError(f"{layer.describe()}: bad value for {key!r}: {exc}") from exc
        if key == "quant_groups":
            if value != target.quant_groups:
                _set_groups(target, value)
        elif key == "prefix_tokens":  # (MatMul: its first operand only, see set_prefix_tokens)
            set_prefix_tokens(target, value)
        else:
            setattr(target, key, value)
        name = getattr(target, "tag", layer.tag)
        _verbose(layer)(f"update {name}_{key} to {value} for index {layer.index}")


def update_quantization_parameter(layer, **parameters) -> dict:
    """Apply one policy block to a Mesa layer (the original's method, validated).

    ``index`` (an int, or a dict by tag) sets the layer's index; a block (``by_index`` with
    settings, optionally ``by_tag``) is applied when the layer's index and tag match. For
    MatMul/Softmax a ``by_tag`` of ``matmul-1`` etc. sets that one quantizer only."""
    if "index" in parameters:
        idx = parameters["index"]
        if isinstance(idx, dict):
            idx = idx.get(layer.tag, layer.index)
        layer.index = _int(idx)
    if "by_index" not in parameters:
        return {}
    by_index = _index_list(parameters["by_index"])
    if by_index != "all" and layer.index not in by_index:
        return {}
    by_tag = _tag_list(parameters.get("by_tag"))
    if by_tag is None or layer.tag in by_tag:
        _apply(layer, layer, parameters)
    elif hasattr(layer, "quant1"):
        for q in (layer.quant1, layer.quant2):
            if q.tag in by_tag:
                _apply(q, layer, parameters)
    return {}


def _set_groups(target, g):
    targets = (target.quant1, target.quant2) if hasattr(target, "quant1") else (target,)
    for q in targets:
        try:
            q._resize_groups(g)
        except ValueError as exc:
            raise PolicyError(str(exc)) from exc


DIST_SYNC_KEY = "_mesa_dist_sync"  # a module's set_dist_sync setting


def set_dist_sync(model: torch.nn.Module, enabled: bool) -> int:
    """Switch the cross-rank all-reduce of the range statistics on or off for every quantizer of
    ``model``; returns the number of quantizers set. Every module also records the setting
    (``_mesa_dist_sync`` in its ``__dict__``), which the compressed-checkpointing input
    quantizer of a block follows (mesa_ops.checkpoint.input_quantizer)."""
    n = 0
    for m in model.modules():
        m.__dict__[DIST_SYNC_KEY] = bool(enabled)
        if isinstance(m, QuantMixin):
            m.dist_sync = bool(enabled)
            n += 1
    return n


def set_prefix_tokens(module: torch.nn.Module, n: int) -> int:
    """Keep the first ``n`` token rows (the class token, 1; with a distillation token, 2) of
    every tensor the Mesa layers of ``module`` store exactly (``prefix_tokens``, see
    :meth:`QuantMixin._with_prefix`). Tokens are dim -2 of what is stored: (B, N, C) tokens,
    SDPA's q / k / v / output in (B, N, H * D) layout, explicit attention's (B, H, N, D) q and
    (B, H, N, M) softmax output; a MatMul's second operand (k^T in q @ k^T) is left as it is.
    Apply it to the modules that see prefix tokens (a ViT's blocks and final norm, PVT's last
    stage). Returns the number of quantizers set."""
    n = _nonneg_int(n)
    skip = {id(m.quant2) for m in module.modules()
            if hasattr(m, "quant2") and type(m).__name__ == "MatMul"}
    count = 0
    for m in module.modules():
        if isinstance(m, QuantMixin) and id(m) not in skip:
            m.prefix_tokens = n
            count += 1
    return count
