"""Mesa attention on PyTorch's scaled-dot-product attention (SDPA) kernels.

The forward runs the very kernel ``F.scaled_dot_product_attention`` would run for the same inputs
(the flash kernel on CPU; flash, memory-efficient or cuDNN on CUDA, as ``aten._fused_sdp_choice``
picks, flash with the head dim padded to a multiple of 8 as F.sdpa pads it; the math composite
where PyTorch uses it), so the output is bit-identical to exact training. One exception: where
PyTorch would pick cuDNN for an additive mask that needs a gradient (Swin's relative position
bias), the memory-efficient kernel runs, since cuDNN's backward gives no mask gradient. For backward it keeps only q, k, v and the output, each packed through the Quantizer
(head-wise groups, as Mesa stores attention tensors: Pan et al., arXiv 2111.11124, Sec. 3.3), and
the fp32 softmax statistics (logsumexp, (B, H, N)) of the fused kernels; no N x M attention matrix
is stored. Backward dequantizes and calls PyTorch's own SDPA backward op, first rerunning the
fused forward on the dequantized q, k, v where ``mod.reruns_forward()`` (below 8 bits or under
range_mode 'ema': a logsumexp consistent with the stored q, k; none is stored then); for the math path
(no output or logsumexp kept) it recomputes the probabilities once from the dequantized q and k
and takes the gradients by hand (:func:`_math_backward`).

Shapes: q (B, H, N, D), k and v (B, H, M, D) (M != N for PVT's spatial reduction); ``bias``
broadcastable to (B, H, N, M) (Swin's relative position bias as (1, H, N, M)); ``window_mask``
(W, N, M) with B = B' * W, added to window ``b % W`` (Swin's shifted windows). Head-wise packing:
each of q, k, v, out is stored as its (B, N, H * D) token layout with H groups of D channels;
the output's packed copy is attached to the merged (B, N, H * D) result so that the following
projection Linear stores the same bytes instead of a second copy (as Softmax's output is shared
with attn @ v).
"""
from __future__ import annotations

import functools

import torch

from ..amp import apply_without_autocast, as_dtype
from ..compat import aten_call
from ..packed import compiling, disarm, release
from ..saved import attach_saved, graph_backward, hand_on, output_copy, save_for_backward, saved_tensors
from ..quant import quantize_many

aten = torch.ops.aten
# torch's SDPBackend numbering (torch.nn.attention.SDPBackend)
MATH, FLASH, EFFICIENT, CUDNN = 0, 1, 2, 3


@functools.lru_cache(maxsize=None)
def _probe_dtype(device_type: str, amp_dtype: torch.dtype, in_dtype: torch.dtype) -> torch.dtype:
    x = torch.ones(1, 1, 2, 8, dtype=in_dtype, device=device_type)
    with torch.no_grad(), torch.autocast(device_type, dtype=amp_dtype):
        return torch.nn.functional.scaled_dot_product_attention(x, x, x).dtype


def build_mask(bias, window_mask, batch: int, dtype):
    """The additive mask as the models pass it to SDPA: ``bias`` (broadcastable to (B, H, N, M))
    or, with ``window_mask`` (W, N, M), (W, H, N, M) for 5-D (B // W, W, H, N, D) inputs."""
    if window_mask is None:
        return as_dtype(bias, dtype)
    if batch % window_mask.shape[0]:
        raise ValueError(f"mesa SDPA: batch {batch} is not a multiple of the {window_mask.shape[0]} "
                         "windows of window_mask")
    am = window_mask.unsqueeze(1)
    if bias is not None:
        am = (bias if bias.dim() == 3 else bias.squeeze(0)).unsqueeze(0) + am
    return am.to(dtype)


def _split(t: torch.Tensor, window_mask):
    """(B, H, L, D) -> (B // W, W, H, L, D) when a window mask is given."""
    if window_mask is None:
        return t
    w = window_mask.shape[0]
    return t.reshape(t.shape[0] // w, w, *t.shape[1:])


def token_layout(x: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) -> (B, L, H * D), a view when ``x`` is a head-split token tensor."""
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b, n, h * d)


def head_layout(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, L, H * D) -> (B, H, L, D) (a view)."""
    b, n, c = t.shape
    return t.view(b, n, heads, c // heads).transpose(1, 2)


def _pack_all(quants, tensors, amp16: bool, traced: bool) -> list:
    """The stored copy of each (B, H, L, D) tensor: its head-wise packed copy (its (B, L, H*D)
    layout, H groups of D) where its quantizer is on, else the tensor itself; the enabled
    quantizers' kernel calls made together (:func:`~mesa_ops.quant.quantize_many`: on CUDA one
    launch for q, k, v)."""
    q, k, v = quants
    if q.enable and k.enable and v.enable:  # (the usual case: no generators)
        x, y, z = tensors
        return quantize_many(((q, x.transpose(1, 2).flatten(2)), (k, y.transpose(1, 2).flatten(2)),
                              (v, z.transpose(1, 2).flatten(2))), amp16, traced)
    on = [(qu, x4.transpose(1, 2).flatten(2)) for qu, x4 in zip(quants, tensors) if qu.enable]
    packed = iter(quantize_many(on, amp16, traced))
    return [next(packed) if qu.enable else x4 for qu, x4 in zip(quants, tensors)]


def _mem_eff_mask(am, q, k):
    """The mask as F.scaled_dot_product_attention hands it to the memory-efficient kernel: rows
    padded to an aligned stride (values unchanged), expanded to (B, H, N, M)."""
    if am is None:
        return None
    m = am.shape[-1]
    if any(s % 16 for s in am.stride()[:-1]):
        am = torch.nn.functional.pad(am, (0, -m % 16))[..., :m]
    return am.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def sdp_choice(q, k, v, am, dropout_p: float, scale, traced: bool | None = None) -> int:
    """The backend ``F.scaled_dot_product_attention`` picks for these inputs (grad mode as now).
    Under torch.compile (``traced``; None to ask) it is read at trace time from the inputs'
    shapes, strides, dtypes, devices and requires_grad (a constant of the graph, no graph
    break)."""
    if q.dim() != 4:
        return MATH
    if compiling() if traced is None else traced:
        metas = tuple(None if t is None else (tuple(t.shape), tuple(t.stride()), t.dtype, t.device,
                                              t.requires_grad) for t in (q, k, v, am))
        return _sdp_choice_of(metas, dropout_p, scale, torch.is_grad_enabled())
    return int(torch._fused_sdp_choice(q, k, v, am, dropout_p, False, scale=scale))


@torch.compiler.assume_constant_result
def _sdp_choice_of(metas, dropout_p: float, scale, grad: bool) -> int:
    """:func:`sdp_choice` of tensors with these (shape, stride, dtype, device, requires_grad)
    (run eagerly while dynamo traces, on empty tensors of that layout)."""
    ts = [None if m is None else torch.empty_strided(m[0], m[1], dtype=m[2], device=m[3]).requires_grad_(m[4])
          for m in metas]
    with torch.set_grad_enabled(grad):
        return int(aten._fused_sdp_choice(*ts, dropout_p, False, scale=scale))



def _fused_forward(choice: int, q, k, v, am, scale):
    """The fused kernel ``choice`` on (B, H, L, D) q, k, v as F.sdpa calls it: (out, logsumexp,
    the tensors its backward takes besides, (max_q, max_k) or None)."""
    if choice == FLASH and q.device.type == "cpu":
        out, lse = torch._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False,
                                                                       attn_mask=am, scale=scale)
        return out, lse, (), None
    if choice == FLASH:  # as F.sdpa: head dims padded to a multiple of 8, the scale of D
        d = q.shape[-1]
        (out, lse, cum_q, cum_k, max_q, max_k, rng, unused, _) = aten._scaled_dot_product_flash_attention(
            _pad8(q), _pad8(k), _pad8(v), 0.0, False, False, scale=_scale(scale, d))
        return out[..., :d], lse, (cum_q, cum_k, rng, unused), (max_q, max_k)
    if choice == CUDNN:
        (out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _) = aten._scaled_dot_product_cudnn_attention(
            q, k, v, am, True, 0.0, False, False, scale=scale)
        return out, lse, (cum_q, cum_k, seed, offset), (max_q, max_k)
    if choice == EFFICIENT:
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            q, k, v, _mem_eff_mask(am, q, k), True, 0.0, False, scale=scale)
        return out, lse, (seed, offset), None
    raise NotImplementedError(f"mesa SDPA: SDPA backend {choice} (overrideable) is not "
                              "supported; choose another with torch.nn.attention.sdpa_kernel")

class _SDPA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, window_mask, scale, mod, cdt, choice, merge, amp16, traced=None):
        if traced is None:  # (sdpa_fn passes it: asked once per call there)
            traced = compiling()
        qc = q if q.dtype is cdt else q.to(cdt)
        kc = k if k.dtype is cdt else k.to(cdt)
        vc = v if v.dtype is cdt else v.to(cdt)
        B, H, N, D = qc.shape
        am = None if bias is None and window_mask is None else build_mask(bias, window_mask, B, cdt)
        if choice == MATH:
            out = aten._scaled_dot_product_attention_math(
                _split(qc, window_mask), _split(kc, window_mask), _split(vc, window_mask), am, 0.0,
                False, None, scale=scale)[0].reshape(B, H, N, D)
            lse, extra = None, ()
        else:
            out, lse, extra, ctx.max_qk = _fused_forward(choice, qc, kc, vc, am, scale)
        mods = mod._modules  # (the quantizers without Module.__getattr__'s frame)
        quant_o = mods["quant_o"]
        ctx.recompute = recompute = choice != MATH and mod.reruns_forward()
        # (B, N, H * D): the merged output, and the layout q, k, v and the output are stored in
        # (made where it is returned or packed: a MATH output or an exact one is kept as it is)
        tok = (out.transpose(1, 2).reshape(B, N, H * D)
               if merge or (choice != MATH and not recompute and quant_o.enable) else None)
        # the backward's rerun gives the output and softmax statistics: the forward's are kept
        # only for the next layer (``attn.proj`` adopts the token-layout output copy)
        qo = None
        if choice != MATH and (merge or not recompute):
            qo = quant_o.quantize(tok, amp16, None, traced) if quant_o.enable else out
        if recompute:
            lse, extra = None, ()
        save_for_backward(ctx, *_pack_all((mods["quant_q"], mods["quant_k"], mods["quant_v"]), (qc, kc, vc),
                                          amp16, traced), qo, lse, bias, window_mask, *extra, traced=traced)
        ctx.mesa_name = mod
        ctx.choice, ctx.scale, ctx.cdt, ctx.heads, ctx.merge = choice, scale, cdt, H, merge
        ctx.traced = traced
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, None if bias is None else bias.dtype)
        # (the token-layout output hands its packed copy on, saved item 3 restoring the same
        # tensor: once for both backwards, outside torch.compile)
        return hand_on(ctx, tok, qo, merge and traced, None, quant_o, 3) if merge else out

    @staticmethod
    def backward(ctx, gy, *unused):  # (once_differentiable, spelt out: saved.once_differentiable)
        if torch.is_grad_enabled():
            return graph_backward(_SDPA.backward, ctx, gy, *unused)
        if gy is None:  # (out_packed: grads are not materialized, the output took no gradient)
            return (None,) * 12
        try:
            traced, H = ctx.traced, ctx.heads
            # q, k, v and the output restored as (B, H, L, D) heads from their (B, L, H * D) token
            # layout (q, k, v by one call where the backend can)
            items = saved_tensors(ctx, False, 3, traced, H, 4)
            qh, kh, vh, oh = items[:4]
            lse, bias, window_mask = items[4:7]
            extra = items[7:]
            cdt, scale = ctx.cdt, ctx.scale
            g = gy.view(gy.shape[0], gy.shape[1], H, -1).transpose(1, 2) if ctx.merge else gy
            g = g if g.dtype is cdt else g.to(cdt)
            gbias = None
            am = None if bias is None and window_mask is None else build_mask(bias, window_mask, qh.shape[0], cdt)
            if ctx.recompute:
                # the softmax statistics and output of the *stored* q, k, v (one fused forward): the
                # backward is then the exact gradient at the dequantized inputs, as the math path's
                # and the explicit path's are. With the forward's exact logsumexp instead, P =
                # exp(q~ k~^T s - lse) does not sum to one and its error grows with the logits' (a
                # bias, issue 20)
                oh, lse, extra, ctx.max_qk = _fused_forward(ctx.choice, qh, kh, vh, am, scale)
            if ctx.choice == FLASH and qh.device.type == "cpu":
                gq, gk, gv = (aten._scaled_dot_product_flash_attention_for_cpu_backward if traced else _CPU_FLASH_BWD)(
                    g, qh, kh, vh, oh, lse, 0.0, False, attn_mask=am, scale=scale)
            elif ctx.choice == FLASH:
                cum_q, cum_k, rng, unused = extra
                d = qh.shape[-1]
                gq, gk, gv = aten._scaled_dot_product_flash_attention_backward(
                    _pad8(g), _pad8(qh), _pad8(kh), _pad8(vh), _pad8(oh), lse, cum_q, cum_k,
                    *ctx.max_qk, 0.0, False, rng, unused, scale=_scale(scale, d))
                gq, gk, gv = gq[..., :d], gk[..., :d], gv[..., :d]
            elif ctx.choice == CUDNN:
                cum_q, cum_k, seed, offset = extra
                gq, gk, gv = aten._scaled_dot_product_cudnn_attention_backward(
                    g, qh, kh, vh, oh, lse, seed, offset, am, cum_q, cum_k, *ctx.max_qk, 0.0, False,
                    scale=scale)
            elif ctx.choice == EFFICIENT:
                seed, offset = extra
                need_bias = bias is not None and ctx.needs_input_grad[3]
                gq, gk, gv, gb = aten._scaled_dot_product_efficient_attention_backward(
                    g, qh, kh, vh, _mem_eff_mask(am, qh, kh), oh, lse, seed, offset, 0.0,
                    [True, True, True, need_bias], False, scale=scale)
                if need_bias:
                    gbias = gb.sum_to_size(bias.shape)
            else:
                gq, gk, gv, gbias = _math_backward(g, qh, kh, vh, am, window_mask, scale,
                                                   bias is not None and ctx.needs_input_grad[3])
                if gbias is not None:  # (H, N, M) with a window mask, else (B, H, N, M)
                    gbias = gbias.unsqueeze(0) if gbias.dim() < bias.dim() else gbias
                    gbias = gbias.sum_to_size(bias.shape)
            # softmax is invariant to a shift of a row of logits, so exact's dK sums to zero over
            # the keys of each (batch, head) (a key bias gets no gradient); the stored q, k, v and
            # the forward's logsumexp break that by the packing error: its projection taken out
            # (the rerun's dK keeps it already, up to rounding; issue 49)
            if am is None:
                gk = gk - gk.mean(dim=-2, keepdim=True)
            else:  # (over the keys some query attends: a masked-out key's dK stays exact's 0)
                live = (gk != 0).any(dim=-1, keepdim=True)
                n = live.sum(dim=-2, keepdim=True).clamp_min(1)
                gk = gk - live * (gk.sum(dim=-2, keepdim=True) / n)
            # (the token-layout tensors restored: the head views carry no buffer)
            for t in items[:4]:
                if getattr(t, "_mesa_ws", None) is not None:
                    release(t)
            dq, dk, dv, db = ctx.dtypes
            return (gq if gq.dtype is dq else gq.to(dq), gk if gk.dtype is dk else gk.to(dk),
                    gv if gv.dtype is dv else gv.to(dv), as_dtype(gbias, db),
                    None, None, None, None, None, None, None, None)
        except BaseException:
            disarm()  # (the engine drops its callbacks: the workspace would stay held)
            raise


def _pad8(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its last dim zero-padded to a multiple of 8 (what F.sdpa hands the CUDA flash
    kernel, which needs it: ``pad_last_dim<8>`` in PyTorch's attention.cpp)."""
    d = t.shape[-1]
    return t if d % 8 == 0 else torch.nn.functional.pad(t, (0, -d % 8))


def _scale(scale, d: int) -> float:
    """The softmax scale SDPA uses for head dim ``d`` (``scale`` or 1 / sqrt(d))."""
    return d ** -0.5 if scale is None else scale


_WIDE = (torch.float32, torch.float64)
# the CPU flash kernel's backward without OpOverload's Python frame (eager mode; traced: the op)
_CPU_FLASH_BWD = aten_call(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)


def _math_backward(g, q, k, v, am, window_mask, scale, need_bias: bool):
    """Gradients of softmax(q k^T * scale + am) v for the math path, by hand from q, k, v
    (B, H, L, D): the probabilities P are recomputed once (one matmul and a softmax; no output
    and no autograd graph), then dV = P^T g, dS = softmax'(g v^T), dQ = dS k * scale,
    dK = dS^T q * scale and d(am) = dS summed over the batch (over the windows' batch items with
    ``window_mask``: (H, N, M) then). As PyTorch's math forward: q and k are scaled by
    sqrt(scale) before their product, rows masked out entirely get P = 0 (safe softmax), and
    fp16 / bf16 inputs are computed in fp32 (an fp16 q k^T overflows where the scaled logits do
    not); the gradients come back in the inputs' dtype."""
    dt = q.dtype
    root = _scale(scale, q.shape[-1]) ** 0.5
    up = (lambda t: t) if dt in _WIDE else (lambda t: None if t is None else t.float())
    q5, k5, v5, g5 = (_split(up(t), window_mask) for t in (q, k, v, g))
    qs, ks = q5 * root, k5 * root
    s = torch.matmul(qs, ks.transpose(-2, -1))
    if am is not None:
        s.add_(up(am))
    p = aten._safe_softmax(s, -1)
    del s
    gv = torch.matmul(p.transpose(-2, -1), g5)
    ds = torch._softmax_backward_data(torch.matmul(g5, v5.transpose(-2, -1)), p, -1, p.dtype)
    del p
    gbias = None
    if need_bias:
        gbias = (ds.sum((0, 1)) if window_mask is not None else ds).to(dt)
    gq = torch.matmul(ds, ks).mul_(root)
    gk = torch.matmul(ds.transpose(-2, -1), qs).mul_(root)
    return (gq.reshape(q.shape).to(dt), gk.reshape(k.shape).to(dt), gv.reshape(v.shape).to(dt),
            gbias)


def sdpa_fn(q, k, v, bias, window_mask, scale: float | None, mod, merge: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale + bias (+ window_mask)) v, stored for backward by the quantizers of
    ``mod`` (``quant_q``, ``quant_k``, ``quant_v``, ``quant_o``).

    Returns (B, H, N, D), or with ``merge`` the (B, N, H * D) token layout that carries the
    output's packed copy for the next Mesa Linear."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"mesa SDPA: expected 4-D (B, H, L, D) q, k, v, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if window_mask is not None and window_mask.dim() != 3:
        raise ValueError(f"mesa SDPA: window_mask must be (W, N, M), got {tuple(window_mask.shape)}")
    traced = compiling()
    dev = q.device.type
    autocast = torch.is_autocast_enabled(dev)
    amp = torch.get_autocast_dtype(dev) if autocast else None  # (what autocast would compute in)
    cdt = _probe_dtype(dev, amp, q.dtype) if autocast and q.is_floating_point() else q.dtype
    if window_mask is not None:
        choice = MATH  # 5-D inputs: what F.scaled_dot_product_attention runs for them
    else:
        am = None if bias is None else build_mask(bias, None, q.shape[0], cdt)
        choice = sdp_choice(q if q.dtype is cdt else q.to(cdt), k if k.dtype is cdt else k.to(cdt),
                            v if v.dtype is cdt else v.to(cdt), am, 0.0, scale, traced=traced)
        if choice == CUDNN and bias is not None and bias.requires_grad:
            choice = EFFICIENT  # cuDNN's backward gives no bias gradient (Swin's relative bias)
    # under torch.compile the packed output comes out of the Function (dynamo keeps no Python
    # attributes on its nodes), for the next Linear to adopt as in eager mode (issue 22.6)
    if not autocast:
        y = _SDPA.apply(q, k, v, bias, window_mask, scale, mod, cdt, choice, merge, False, traced)
    else:
        y = apply_without_autocast(dev, traced, _SDPA.apply, q, k, v, bias, window_mask, scale, mod, cdt,
                                   choice, merge, amp == torch.float16, traced)
    if not (merge and traced):
        return y
    quant_o = mod.quant_o
    y, qo = output_copy(y, quant_o, cdt)
    return y if qo is None else attach_saved(y, qo, quant_o.stochastic)
