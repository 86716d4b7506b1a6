"""Pure-PyTorch reference of Mesa's quantizer: the specification the C++ and CUDA kernels equal.

The math is the one of ``cuda/quant_math.h`` (see there for the formulas). A tensor is viewed as
``(outer, G, inner)``; element ``e`` belongs to group ``(e // inner) % G``. Codes of ``bits`` bits
are packed low bits first, ``8 // bits`` codes per byte, into ``ceil(numel * bits / 8)`` bytes.

Every float step below is one IEEE-rounded PyTorch op, in the same order as the kernels, so the
results are bit-identical for the same seed.
"""
from __future__ import annotations

import torch

_MUL1 = 0x21F0AAAD
_MUL2 = 0x735A2D97
_GOLDEN = 0x9E3779B9
_MASK32 = 0xFFFFFFFF


def splitmix64(z: int) -> int:
    """SplitMix64's finalizer on a Python int (the seed hash of quant_api.h / ops.make_seed)."""
    m = (1 << 64) - 1
    z = (z + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def hash32(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit integer hash of quant_math.h on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _MASK32
    return x ^ (x >> 15)


def uniform_noise(seed: int, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Noise u in [0, 1) (16 random bits) for element indices 0..numel-1, as float32: one hash
    per pair of elements (e and e + 8 within each aligned block of 16, see quant_math.h)."""
    i = torch.arange(numel, dtype=torch.int64, device=device)
    p = ((i >> 4) << 3) | (i & 7)
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    hi = (((p >> 32) ^ (s >> 32)) * _GOLDEN) & _MASK32  # < 2^32 * 2^32: fits int64 only masked
    h = hash32((((p & _MASK32) ^ (s & _MASK32)) + hi) & _MASK32)
    bits16 = torch.where((i & 8) != 0, h >> 16, h & 0xFFFF)
    return bits16.to(torch.float32) * (1.0 / 65536.0)


def group_index(numel: int, groups: int, inner: int, device) -> torch.Tensor:
    return (torch.arange(numel, device=device) // inner) % groups


def group_minmax(x: torch.Tensor, groups: int, inner: int) -> torch.Tensor:
    """Per-group (min, max) of contiguous ``x`` as a (2, G) float32 tensor; NaN where non-finite."""
    v = x.reshape(-1, groups, inner).float()
    mn, mx = v.amin(dim=(0, 2)), v.amax(dim=(0, 2))
    bad = ~torch.isfinite(mx - mn)
    nan = torch.full_like(mn, float("nan"))
    return torch.stack([torch.where(bad, nan, mn), torch.where(bad, nan, mx)])


RANGE_EPS = 1e-8
# range modes, in the order of cuda/quant_math.h's kRangeEma / kRangeBatch / kRangeUnion
RANGE_MODES = ("ema", "batch", "union")
EMA, BATCH, UNION = 0, 1, 2


def range_update(x: torch.Tensor, groups: int, inner: int, clip_val: torch.Tensor,
                 shift: torch.Tensor, iteration: torch.Tensor, decay: float, one_minus_decay: float,
                 range_mode: int, bits: int, update: bool = True, minmax=None) -> torch.Tensor:
    """Running-range update of (clip_val, shift, iteration) in place from the batch's per-group
    min/max (first step or ``range_mode`` BATCH: the batch's; else EMA), and the scales to
    quantize this batch with: a (4, G) float32 tensor of rows inv = L / r, step = r / L
    (r = max(range, 1e-8)), offset, finite (1/0). The range is the running one (EMA, BATCH) or,
    under UNION, its union with the batch's [min, max], so that no value is clamped. State is left
    unchanged when any group holds NaN/Inf (or a range that overflows float32) or ``update`` is
    False (activation-checkpoint recomputation). No host sync."""
    mm = (minmax or group_minmax)(x, groups, inner)
    lo, hi = mm[0], mm[1]
    finite = torch.isfinite(lo) & torch.isfinite(hi)
    ok = finite.all() & update
    rng = hi - lo
    take = iteration.reshape(()) == 0
    if range_mode == BATCH:
        take = torch.ones_like(take)
    new_clip = torch.where(take, rng, clip_val * decay + rng * one_minus_decay)
    new_shift = torch.where(take, lo, shift * decay + lo * one_minus_decay)
    clip_val.copy_(torch.where(ok, new_clip, clip_val))
    shift.copy_(torch.where(ok, new_shift, shift))
    iteration.add_(ok.to(iteration.dtype))
    qlo, qrange = shift.clone(), clip_val.clone()
    if range_mode == UNION:  # (NaN lo/hi compare False: a non-finite group keeps the state's)
        top = shift + clip_val
        qlo = torch.where(lo < shift, lo, shift)
        qrange = torch.where(hi > top, hi, top) - qlo
    r = qrange.clamp_min(RANGE_EPS)
    levels = torch.full_like(r, float((1 << bits) - 1))
    return torch.stack([levels / r, r / levels, qlo, finite.to(torch.float32)])


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(numel,) int codes < 2^bits -> (ceil(numel*bits/8),) uint8, low bits first."""
    per = 8 // bits
    n = codes.numel()
    nbytes = (n + per - 1) // per
    c = torch.zeros(nbytes * per, dtype=torch.int32, device=codes.device)
    c[:n] = codes.to(torch.int32)
    c = c.view(nbytes, per)
    shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
    return (c << shifts).sum(dim=1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Packed bytes -> (numel,) int32 codes (low bits first within a byte)."""
    if bits == 8:
        return packed.to(torch.int32)[:numel]
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    c = (packed.to(torch.int32).unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return c.reshape(-1)[:numel]


def quantize(x: torch.Tensor, inv: torch.Tensor, shift: torch.Tensor, bits: int, groups: int,
             inner: int, seed: int, stochastic: bool = True) -> torch.Tensor:
    """Contiguous ``x`` -> packed uint8 codes. ``inv`` = L / range and ``shift`` per group (G,)."""
    n = x.numel()
    xf = x.reshape(-1).float()
    if bits == 1:
        return pack_codes((xf > 0).to(torch.int32), 1)
    g = group_index(n, groups, inner, x.device)
    noise = uniform_noise(seed, n, x.device) if stochastic else torch.full_like(xf, 0.5)
    v = (xf - shift.float()[g]) * inv.float()[g]
    v = v + noise
    v = torch.nan_to_num(v, nan=0.0)  # as the kernels: NaN -> code 0 (only with check_finite off)
    v = torch.clamp(v, min=0.0, max=float((1 << bits) - 1))
    return pack_codes(v.to(torch.int32), bits)


def dequantize(packed: torch.Tensor, step: torch.Tensor, shift: torch.Tensor, bits: int,
               groups: int, inner: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Packed codes -> flat (numel,) tensor of ``dtype``: q * step + shift per group."""
    q = unpack_codes(packed, bits, numel).to(torch.float32)
    g = group_index(numel, groups, inner, packed.device)
    return (q * step.float()[g] + shift.float()[g]).to(dtype)


def levels(step: torch.Tensor, shift: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """(G, 2^bits): every value a group's codes dequantize to, code * step + shift (fp32, as the
    kernels compute it), in ``dtype``."""
    q = torch.arange(1 << bits, dtype=torch.float32, device=step.device)
    return (q.unsqueeze(0) * step.float().unsqueeze(1) + shift.float().unsqueeze(1)).to(dtype)


def lut_apply(packed: torch.Tensor, table: torch.Tensor, bits: int, groups: int, inner: int,
              numel: int, mul: torch.Tensor | None = None) -> torch.Tensor:
    """Flat (numel,) ``table[group][code]`` (times ``mul`` when given): a function of a stored
    tensor read off a (G, 2^bits) table per group instead of computed per element. int32
    indices, offset per group in place: ~4 bytes of temporaries per element besides the result
    (the CUDA backend runs this)."""
    levels = 1 << bits
    q = unpack_codes(packed, bits, numel)  # int32
    if groups > 1:
        offsets = torch.arange(groups, dtype=q.dtype, device=q.device).mul_(levels)
        q = q.view(-1, groups, inner).add_(offsets.view(1, groups, 1)).view(-1)
    v = torch.index_select(table.reshape(-1), 0, q)  # int32 indices as they are (CPU and CUDA)
    return v if mul is None else v.mul_(mul.reshape(-1))
