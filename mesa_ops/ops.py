"""Mesa's kernels as torch ops (namespace ``mesa``), with fake implementations, and Mesa's seed stream.

While ``torch.compile`` traces, a stored activation is one native op, opaque to the compiler (its
fake implementation gives shapes and dtypes), so a Mesa layer compiles without graph breaks while
the packed bytes stay those of the kernels in ``cuda/``; the compiled graphs call the ops' C++
kernels (cuda/torch_ops.h) through the dispatcher, without a Python frame (issue 48, item 2).
Eager mode calls the kernels directly (:meth:`mesa_ops.quant.QuantMixin.quantize`'s native step).

  * ``mesa::quantize_step(x, groups, inner, clip_val!, shift!, iteration!, decay, 1 - decay,
    range_mode, bits, update, base, draws!, stochastic, nonfinite_mode, name, salt_name)`` ->
    (uint8 codes, (4, G) rows inv / step / shift / finite): the running-range update of Mesa (Pan
    et al., arXiv 2111.11124, Sec. 3.3) in place and the codes, stochastically rounded with the
    seed :func:`make_seed` gives (torch's generator state hashed without drawing from it, so a
    run draws the same torch random numbers with Mesa on or off; the salt of ``salt_name`` under
    Mesa's ``base``; the draw counter, advanced when ``update``). A non-finite activation is
    reported by :func:`native_nonfinite` (raise or warn once on the CPU, deferred on CUDA).
  * ``mesa::unpack(packed, step, shift, bits, groups, inner, numel, dtype) -> (numel,)``;
    ``mesa::pack(x, inv, shift, bits, groups, inner)``: codes rounded to nearest (the ReLU's mask);
    ``mesa::lut_apply(packed, table, bits, groups, inner, numel, mul?)``: table[group][code] (* mul),
    a function of a stored tensor through a per-group table (GELU's output and derivative).
  * ``mesa::range_update`` and ``mesa::quantize``: the same two steps as Python custom ops, for a
    range all-reduced across ranks (``dist_sync`` under torch.distributed: the all-reduce runs in
    Python), and :func:`_range_update_impl` / :func:`_quantize_impl` the general eager path.
"""
from __future__ import annotations

import ctypes
import warnings
import zlib

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

from . import backend, nonfinite, reference
from .backend import BackendUnavailable, forced_backend, get_backend, kernel_for

_MASK64 = (1 << 64) - 1
_SEED_MASK = (1 << 62) - 1
_BASE = [0]  # Mesa's stream: seeds differ for each base value (a host int: never a tensor read)


_splitmix64 = reference.splitmix64


# the bytes of torch's generator state the fingerprint hashes: the first 64 of get_state() (the
# initial seed, the position in the Mersenne-Twister block and words 0-4 of the block, which
# each regeneration of the block changes); hashing all 5 KB took longer than quantizing a
# small activation. = kFingerprintBytes of cuda/quant_cpu.cpp
FINGERPRINT_BYTES = 64
_HEAD = ctypes.c_char * FINGERPRINT_BYTES


def torch_fingerprint(device: torch.device | None = None) -> int:
    """A 32-bit fingerprint (CRC-32) of torch's default generator state for ``device`` (None or
    a CPU device: the CPU generator, its first :data:`FINGERPRINT_BYTES` bytes; a CUDA device:
    that device's generator, its 16 bytes of seed and offset, read on the host), read without
    drawing from it."""
    if device is not None and device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        state = torch.cuda.default_generators[idx].get_state()
        return zlib.crc32(state.numpy().tobytes())
    state = torch.default_generator.get_state()  # a fresh uint8 CPU tensor
    return zlib.crc32(_HEAD.from_address(state.data_ptr()))


def make_seed(salt: int, count: int, device: torch.device | None = None, base: int | None = None) -> int:
    """The seed of one stochastic rounding: a hash of torch's generator state (so
    ``torch.manual_seed`` fixes it; torch's generator is read, never drawn from, so its stream --
    dropout, drop-path -- is the same with Mesa on or off), Mesa's base (``base``, else the
    current one), the layer's ``salt`` and its draw ``count``:
    ``splitmix64(seed_prefix(salt) ^ count)``, 62 bits."""
    return _splitmix64(seed_prefix(salt, device, base) ^ count) & _SEED_MASK


_SALT_MIX: dict = {}  # salt -> splitmix64(base ^ splitmix64(salt)) under the current base


def salt_mix(salt: int, base: int | None = None) -> int:
    """The part of :func:`seed_prefix` that depends on Mesa's base (``base``, else the current
    one, cached) and the salt only (64 bits; the CPU kernel hashes torch's generator state with it
    itself: ``prefix_of_mix``)."""
    if base is not None:
        return _splitmix64(base ^ _splitmix64(salt))
    mix = _SALT_MIX.get(salt)
    if mix is None:
        mix = _SALT_MIX[salt] = _splitmix64(_BASE[0] ^ _splitmix64(salt))
    return mix


SIGNED_MIX: dict = {}  # salt -> salt_mix(salt) as a signed int64 (the kernels' argument)


def signed_salt_mix(salt: int) -> int:
    """:func:`salt_mix` as the int64 with the same bits (cached in :data:`SIGNED_MIX`, which the
    quantizers read directly: once per stored activation)."""
    mix = SIGNED_MIX[salt] = signed64(salt_mix(salt))
    return mix


def seed_prefix(salt: int, device: torch.device | None = None, base: int | None = None) -> int:
    """The part of :func:`make_seed` that does not depend on the draw count (64 bits):
    ``splitmix64(torch_fingerprint(device) ^ salt_mix(salt, base))``."""
    return _splitmix64(torch_fingerprint(device) ^ salt_mix(salt, base))


def signed64(v: int) -> int:
    """A 64-bit unsigned value as the int64 with the same bits (for a C++ int64_t argument)."""
    return v - (1 << 64) if v >> 63 else v


_SALTS: dict = {}  # layer name -> CRC-32 salt


def salt_of(name: str) -> int:
    """The CRC-32 salt of the quantizer named ``name``."""
    salt = _SALTS.get(name)
    if salt is None:
        salt = _SALTS[name] = zlib.crc32(name.encode())
    return salt


def draw_seed(draws: torch.Tensor, name: str, advance: bool,
              device: torch.device | None = None, base: int | None = None) -> int:
    """The seed of the next stochastic rounding of the quantizer named ``name`` whose (1,) int64
    CPU draw counter is ``draws`` (advanced by one when ``advance``), for a tensor on ``device``
    (``base``: Mesa's base, else the current one)."""
    n = int(draws[0])
    if advance:
        draws[0] = n + 1
    return make_seed(salt_of(name), n, device, base)


def get_rng_state() -> torch.Tensor:
    """Mesa's generator base (an int64 tensor of 1 value; torch.save / weights_only=True load
    it). The seeds also depend on torch's generator state and on each quantizer's draw count,
    which resumes from its ``iteration`` buffer (state dict): restoring the model, torch's RNG
    state and this gives the same noise."""
    return torch.tensor([_BASE[0]], dtype=torch.int64)


def set_rng_state(state) -> None:
    """Restore a base from :func:`get_rng_state` (another value gives an independent stream)."""
    t = torch.as_tensor(state)
    if t.dtype != torch.int64 or t.shape != (1,):
        raise ValueError(f"mesa set_rng_state: expected an int64 tensor of shape (1,) "
                         f"from ms.get_rng_state(), got dtype {t.dtype} shape {tuple(t.shape)}")
    _BASE[0] = int(t.cpu()[0])
    _SALT_MIX.clear()
    SIGNED_MIX.clear()


def dist_world() -> int:
    """The number of ranks when torch.distributed is initialized, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def _synced_minmax(be, x, groups, inner):
    """Per-group (2, G) min/max of ``x`` reduced over all ranks (MIN of min, MAX of max); a
    non-finite group on any rank stays non-finite everywhere, so every rank skips alike."""
    mm = be.group_minmax(x, groups, inner)
    v = torch.stack([-mm[0], mm[1]]).nan_to_num(nan=float("inf"))
    dist.all_reduce(v, op=dist.ReduceOp.MAX)
    return torch.stack([-v[0], v[1]])


def _range_update_impl(x: torch.Tensor, clip_val: torch.Tensor, shift: torch.Tensor,
                       iteration: torch.Tensor, groups: int, inner: int, decay: float,
                       range_mode: int, bits: int, update: bool, nonfinite_mode: str, name: str,
                       sync: bool) -> torch.Tensor:
    """Running-range update in place; returns (4, G): inv, step, offset, finite (1/0) of the
    range this batch is quantized with (``range_mode``: reference.EMA / BATCH / UNION)."""
    be = kernel_for(get_backend(x), x, x.dtype, bits)
    if sync and update and dist_world() > 1:
        mm = _synced_minmax(be, x, groups, inner)
        params = reference.range_update(x, groups, inner, clip_val, shift, iteration, decay,
                                        1.0 - decay, range_mode, bits, update,
                                        minmax=lambda *_: mm)
    else:
        params = be.range_update(x, groups, inner, clip_val, shift, iteration, decay, 1.0 - decay,
                                 range_mode, bits, update)
    if nonfinite_mode == "skip":  # a non-finite group's stored copy dequantizes to NaN (its
        # codes are 0): the gradient is non-finite, as in exact training, and GradScaler skips
        params[2] = torch.where(params[3] > 0, params[2], torch.full_like(params[2], float("nan")))
    report_nonfinite(params[3], None, nonfinite_mode, name, x)
    return params


def report_nonfinite(flags: torch.Tensor, finite, mode: str, layer, x: torch.Tensor) -> None:
    """Report a non-finite activation ``x`` of ``layer`` (a name or a module) by ``mode``: at once
    where the kernel gave a host flag ``finite`` (the CPU, or a CPU tensor's ``flags``), else
    deferred on the device flags (no host sync, :mod:`mesa_ops.nonfinite`)."""
    if finite is None and not (x.is_cuda or x.is_meta or type(flags) is FakeTensor):
        finite = bool(flags.all())  # (a CPU tensor: no sync)
    if finite is None:
        nonfinite.defer(flags, mode, layer, x.shape)
    elif not finite:
        name = layer if isinstance(layer, str) else layer.describe()
        if nonfinite.must_report(mode, name):
            nonfinite.report(mode, name, x.shape)


_range_update_op = torch.library.custom_op("mesa::range_update", _range_update_impl,
                                           mutates_args=("clip_val", "shift", "iteration"))


@_range_update_op.register_fake
def _(x, clip_val, shift, iteration, groups, inner, decay, range_mode, bits, update,
      nonfinite_mode, name, sync):
    return x.new_empty((4, groups), dtype=torch.float32)


def _quantize_impl(x: torch.Tensor, inv: torch.Tensor, shift: torch.Tensor, draws: torch.Tensor,
             name: str, bits: int, groups: int, inner: int, stochastic: bool,
             advance: bool) -> torch.Tensor:
    """Contiguous ``x`` -> packed uint8 codes (ceil(numel * bits / 8),). ``draws`` is the
    quantizer's (1,) int64 CPU draw counter (advanced by one when ``advance``); ``name`` (the
    layer's) salts its seed."""
    seed = draw_seed(draws, name, advance, x.device) if stochastic else 0
    return kernel_for(get_backend(x), x, x.dtype, bits).quantize(x, inv, shift, bits, groups, inner,
                                                                 seed, stochastic)


_quantize_op = torch.library.custom_op("mesa::quantize", _quantize_impl, mutates_args=("draws",))


@_quantize_op.register_fake
def _(x, inv, shift, draws, name, bits, groups, inner, stochastic, advance):
    per = 8 // bits
    return x.new_empty(((x.numel() + per - 1) // per,), dtype=torch.uint8)


def _dequantize_impl(packed: torch.Tensor, step: torch.Tensor, shift: torch.Tensor, bits: int,
               groups: int, inner: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Packed codes -> flat (numel,) tensor of ``dtype``: code * step + shift per group."""
    be = kernel_for(get_backend(packed), packed, dtype, bits)
    return be.dequantize(packed, step, shift, bits, groups, inner, numel, dtype)


# ---- the native ops (issue 48, item 2): C++ kernels the compiled graphs call without Python ----
# mesa::quantize_step, mesa::unpack, mesa::pack and mesa::lut_apply: schemas and fake implementations here; the kernels of
# cuda/torch_ops.h registered for the CPU / CUDA key by the first call on such a tensor (the
# Python fallback below: it loads the extension, registers its kernels where they are the ones
# this tensor's device uses and calls the op again; where they are not -- MESA_BACKEND=torch,
# no compiler, a failed CUDA self-check -- it computes the same result in Python).
_LIB = torch.library.Library("mesa", "FRAGMENT")
_LIB.define("quantize_step(Tensor x, int groups, int inner, Tensor(a!) clip_val, Tensor(b!) shift, "
            "Tensor(c!) iteration, float decay, float one_minus_decay, int range_mode, int bits, "
            "bool update, int base, Tensor(d!) draws, bool stochastic, str nonfinite_mode, str name, "
            "str salt_name) -> (Tensor, Tensor)")
_LIB.define("unpack(Tensor packed, Tensor step, Tensor shift, int bits, int groups, int inner, "
            "SymInt numel, ScalarType dtype) -> Tensor")
_LIB.define("pack(Tensor x, Tensor inv, Tensor shift, int bits, int groups, int inner) -> Tensor")
_LIB.define("lut_apply(Tensor packed, Tensor table, int bits, int groups, int inner, SymInt numel, "
            "Tensor? mul) -> Tensor")
_NATIVE: dict = {}  # "cpu" / "cuda" -> the extension whose kernels of the ops are registered for it
_CHECKED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _native_registered(t: torch.Tensor, dtype: torch.dtype, bits: int) -> bool:
    """Register the extension's kernels of the native ops for ``t``'s device type where they are
    the ones it uses (the C++ build on the CPU; on CUDA the CUDA build once its self-check passed
    for every dtype and width on every device: the compiled graphs then call it for all of them);
    whether they now are."""
    dev = t.device.type
    if dev not in ("cpu", "cuda") or dev in _NATIVE or forced_backend() == "torch":
        return False  # (registered: the dispatcher would not have come here)
    try:
        be = kernel_for(get_backend(t), t, dtype, bits)
        ext = getattr(be, "ext", None)
        if ext is None or be.name != dev or not hasattr(ext, "register_ops"):
            return False
        if dev == "cuda":
            for i in range(torch.cuda.device_count()):
                probe = torch.empty(0, device=f"cuda:{i}")
                if any(kernel_for(be, probe, d, b) is not be for d in _CHECKED_DTYPES for b in (8, 4, 2, 1)):
                    return False
    except BackendUnavailable:  # (MESA_BACKEND=cuda and a case that fails: that call raises itself)
        return False
    if not ext.register_ops(dev, native_nonfinite):
        return False
    _NATIVE[dev] = ext
    return True


backend.ON_CLEAR.append(lambda: unregister_native())


@torch.compiler.assume_constant_result
def native_wanted() -> bool:
    """Whether the traced graphs' native ops may run the extension's kernels: not under
    MESA_BACKEND=torch, read while dynamo traces (run then, not traced: where the variable says
    torch the kernels registered before are withdrawn, so that the ops' Python fallback computes
    with the reference). Returns True otherwise."""
    if forced_backend() == "torch":
        unregister_native()
        return False
    return True


def unregister_native() -> None:
    """Withdraw the extension's kernels of the native ops (every key; backend.clear_caches too):
    the ops' Python fallback runs again, and registers them anew where they apply."""
    for dev, ext in _NATIVE.items():
        ext.unregister_ops(dev)
    _NATIVE.clear()


def _quantize_step_fallback(x, groups, inner, clip_val, shift, iteration, decay, one_minus_decay, range_mode,
                            bits, update, base, draws, stochastic, nonfinite_mode, name, salt_name):
    if _native_registered(x, x.dtype, bits):
        return torch.ops.mesa.quantize_step.default(
            x, groups, inner, clip_val, shift, iteration, decay, one_minus_decay, range_mode, bits, update,
            base, draws, stochastic, nonfinite_mode, name, salt_name)
    params = _range_update_impl(x, clip_val, shift, iteration, groups, inner, decay, range_mode, bits,
                                update, nonfinite_mode, name, False)
    seed = draw_seed(draws, salt_name, update, x.device, base) if stochastic else 0
    packed = kernel_for(get_backend(x), x, x.dtype, bits).quantize(x, params[0], params[2], bits, groups,
                                                                   inner, seed, stochastic)
    return packed, params


def _unpack_fallback(packed, step, shift, bits, groups, inner, numel, dtype):
    if _native_registered(packed, dtype, bits):
        return torch.ops.mesa.unpack.default(packed, step, shift, bits, groups, inner, numel, dtype)
    return _dequantize_impl(packed, step, shift, bits, groups, inner, numel, dtype)


def _pack_impl(x, inv, shift, bits, groups, inner):
    """Codes of ``x`` rounded to nearest by its backend's kernel (no draw)."""
    return kernel_for(get_backend(x), x, x.dtype, bits).quantize(x, inv, shift, bits, groups, inner, 0, False)


def _pack_fallback(x, inv, shift, bits, groups, inner):
    if _native_registered(x, x.dtype, bits):
        return torch.ops.mesa.pack.default(x, inv, shift, bits, groups, inner)
    return _pack_impl(x, inv, shift, bits, groups, inner)


def _lut_apply_fallback(packed, table, bits, groups, inner, numel, mul):
    if _native_registered(packed, table.dtype, bits):
        return torch.ops.mesa.lut_apply.default(packed, table, bits, groups, inner, numel, mul)
    be = kernel_for(get_backend(packed), packed, table.dtype, bits)
    kernel = getattr(be, "lut_apply_out", None)
    if kernel is None:
        return reference.lut_apply(packed, table, bits, groups, inner, numel, mul)
    out = torch.empty(numel, dtype=table.dtype, device=packed.device)
    return kernel(packed, table.contiguous(), bits, groups, inner, out, None if mul is None else mul.contiguous(),
                  None)


_LIB.impl("lut_apply", _lut_apply_fallback, "CompositeExplicitAutograd")
_LIB.impl("quantize_step", _quantize_step_fallback, "CompositeExplicitAutograd")
_LIB.impl("pack", _pack_fallback, "CompositeExplicitAutograd")
_LIB.impl("unpack", _unpack_fallback, "CompositeExplicitAutograd")


@torch.library.register_fake("mesa::quantize_step", lib=_LIB)
def _(x, groups, inner, clip_val, shift, iteration, decay, one_minus_decay, range_mode, bits, update, base,
      draws, stochastic, nonfinite_mode, name, salt_name):
    per = 8 // bits
    return (x.new_empty(((x.numel() + per - 1) // per,), dtype=torch.uint8),
            x.new_empty((4, groups), dtype=torch.float32))


@torch.library.register_fake("mesa::pack", lib=_LIB)
def _(x, inv, shift, bits, groups, inner):
    per = 8 // bits
    return x.new_empty(((x.numel() + per - 1) // per,), dtype=torch.uint8)


@torch.library.register_fake("mesa::lut_apply", lib=_LIB)
def _(packed, table, bits, groups, inner, numel, mul):
    return packed.new_empty((numel,), dtype=table.dtype)


@torch.library.register_fake("mesa::unpack", lib=_LIB)
def _(packed, step, shift, bits, groups, inner, numel, dtype):
    return packed.new_empty((numel,), dtype=dtype)


def native_nonfinite(flags: torch.Tensor, mode: str, name: str, shape) -> None:
    """The report of a non-finite activation found by a native op's kernel (cuda/torch_ops.h):
    at once on the CPU, deferred on CUDA (:func:`report_nonfinite`)."""
    if flags.is_cuda:
        nonfinite.defer(flags, mode, name, tuple(shape))
    elif not bool(flags.all()) and nonfinite.must_report(mode, name):
        nonfinite.report(mode, name, tuple(shape))


def quantize_step(x, groups, inner, clip_val, shift, iteration, decay, range_mode, bits, update, draws,
                  stochastic, nonfinite_mode, name, salt_name):
    """``mesa::quantize_step`` (while torch.compile traces; the eager path is
    :meth:`~mesa_ops.quant.QuantMixin.quantize`'s native step): the range update and the codes
    of a contiguous ``x`` in one native call -> (packed codes, (4, G) rows inv / step / shift /
    finite); Mesa's generator base is read here (dynamo guards on it: a new base retraces)."""
    native_wanted()
    return torch.ops.mesa.quantize_step.default(x, groups, inner, clip_val, shift, iteration, decay,
                                                1.0 - decay, range_mode, bits, update, _BASE[0], draws,
                                                stochastic, nonfinite_mode, name, salt_name)


# Eager mode calls the implementations directly (the custom-op dispatch costs ~0.1 ms a call in
# Python); while torch.compile traces, the registered ops (opaque, with fake implementations).
def range_update(*args) -> torch.Tensor:
    """``mesa::range_update`` (see :func:`_range_update_impl`)."""
    return (_range_update_op if torch.compiler.is_compiling() else _range_update_impl)(*args)


def quantize(*args) -> torch.Tensor:
    """``mesa::quantize`` (see :func:`_quantize_impl`)."""
    return (_quantize_op if torch.compiler.is_compiling() else _quantize_impl)(*args)


def lut_apply(packed, table, bits, groups, inner, numel, mul=None) -> torch.Tensor:
    """``mesa::lut_apply`` (while torch.compile traces; eager mode calls the backend's
    ``lut_apply_out``): flat (numel,) table[group][code] (* mul)."""
    native_wanted()
    return torch.ops.mesa.lut_apply.default(packed, table, bits, groups, inner, numel, mul)


def pack(x, inv, shift, bits, groups, inner) -> torch.Tensor:
    """Codes of a contiguous ``x`` rounded to nearest (no draw; the ReLU's mask): the backend's
    kernel, or while torch.compile traces the native op ``mesa::pack``."""
    if torch.compiler.is_compiling():
        native_wanted()
        return torch.ops.mesa.pack.default(x, inv, shift, bits, groups, inner)
    return _pack_impl(x, inv, shift, bits, groups, inner)


def dequantize(*args) -> torch.Tensor:
    """``mesa::unpack`` (see :func:`_dequantize_impl`): while torch.compile traces the native op."""
    if torch.compiler.is_compiling():
        native_wanted()
        return torch.ops.mesa.unpack.default(*args)
    return _dequantize_impl(*args)
