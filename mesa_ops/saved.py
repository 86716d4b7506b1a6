"""How Mesa's autograd Functions keep their packed copies (:mod:`mesa_ops.packed`) for backward.

:func:`save_for_backward` / :func:`saved_tensors` store any mix of packed copies, tensors and
None in an autograd ctx in a fixed layout and restore them (one native call per copy);
:func:`attach_saved` / :func:`find_saved` / :func:`adopt_saved` hand a layer's copy to the next
layer, which then stores nothing (:class:`Share`: the tensor restored once for both backwards);
:func:`once_differentiable` / :func:`graph_backward`: a Mesa backward is not differentiable
again, and says so naming the layer."""
from __future__ import annotations

import functools

import torch
from torch.autograd import function as _autograd_function

from . import nonfinite
from . import packed as _p  # (_p._graph_task_id read through the module: tests replace it there)
from .compat import SAVES_TO_SLOT
from .packed import (CHANNELS_LAST, AffineQTensor, MappedQTensor, QTensor, _affine, _local, _tnew, compiling,
                     disarm, restore, restorer, split_heads)


def _layer_name(ctx) -> str:
    """The layer a Function's ``ctx.mesa_name`` names: a string, or the quantizer / module
    itself (described only when needed: the forward runs once per layer and step)."""
    name = getattr(ctx, "mesa_name", "?")
    return name if isinstance(name, str) else name.describe()


def once_differentiable(fn):
    """``torch.autograd.function.once_differentiable`` with a message naming Mesa: a Mesa
    backward runs without recording a graph (its inputs are lossy packed copies), and a second
    differentiation through it (gradient penalty, ``create_graph=True``) raises. The hot
    backwards (Linear, LayerNorm, GELU, SDPA) spell the same out without this wrapper's frame::

        if torch.is_grad_enabled():
            return graph_backward(Fn.backward, ctx, *grads)
        try:
            ...  # the backward
        except BaseException:
            disarm()
            raise
    """

    @functools.wraps(fn)
    def wrapper(ctx, *args):
        if not torch.is_grad_enabled():  # the usual backward (create_graph=False): as plain does
            try:
                return fn(ctx, *args)
            except BaseException:
                disarm()  # the engine drops its callbacks: the buffers would stay held
                raise
        return graph_backward(fn, ctx, *args)
    return wrapper


def graph_backward(fn, ctx, *args):
    """A Mesa backward ``fn`` asked for with grad mode on (``create_graph=True``, or while
    torch.compile traces): ``fn`` run under no_grad (where it takes its usual path), its
    outputs raising when differentiated again."""
    if compiling():
        return _autograd_function.once_differentiable(fn)(ctx, *args)
    with torch.no_grad():
        outputs = fn(ctx, *args)
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return outputs
    outs = outputs if isinstance(outputs, tuple) else (outputs,)
    err = torch._C._functions.DelayedError(
        f"mesa_ops: double backward through the Mesa layer {_layer_name(ctx)} "
        "is not supported "
        "(it saved a lossy packed copy of its input and its backward is not differentiable); "
        "turn compression off for it (enable=False) to take gradients of gradients".encode(),
        len(outs))
    res = err(*[o.detach().requires_grad_() if o is not None else None for o in outs])
    res = res if isinstance(res, tuple) else (res,)
    return res if isinstance(outputs, tuple) else res[0]


class Share:
    """One dequantized copy handed between two backwards that restore the same packed tensor: a
    consumer (the Linear fed by a LayerNorm, the projection after SDPA) restores it first, the
    producer (the LayerNorm, the SDPA) takes it instead of restoring it again, and releases it.
    ``t`` is the restored tensor while it waits, else None (the class's value: a new box is made
    without a Python call, once per producer)."""
    t = None


def attach_saved(t: torch.Tensor, qt: QTensor, stochastic: bool = True, producer=None,
                 item: int = 0) -> torch.Tensor:
    """Record on ``t`` that ``qt`` is a packed copy of it (rounded stochastically or not), so a
    later Mesa layer that needs the same tensor for backward (attn@v after softmax) saves these
    bytes instead of a second copy; returns the tensor to hand on: ``t``, or while torch.compile
    traces a view of it carrying the record (dynamo of torch <= 2.8 sets no attribute on a custom
    autograd Function's output; a view is free in the compiled graph). ``producer``: the autograd
    node (ctx) whose saved item ``item`` restores to the same tensor as ``qt``; the two backwards
    then restore it once."""
    if compiling():
        t = t.view_as(t)
        t._mesa_saved = (qt, None, bool(stochastic), None)
        return t
    share = None
    if producer is not None:
        share = Share()
        producer.mesa_share = (item, share, None)
    t._mesa_saved = (qt, t._version, bool(stochastic), share)
    return t


def hand_on(ctx, y: torch.Tensor, q, out_packed: bool, record=None, quant=None,
            share_item: int | None = None):
    """What a Mesa Function returns with the packed copy ``q`` it hands the next layer (a
    LayerNorm's x-hat, a GELU's input, a Softmax's or SDPA's output; None or a tensor stored
    exactly: nothing): in eager mode ``y``, carrying ``record`` (``q`` when None: a LayerNorm's
    :class:`AffineQTensor`, a GELU's :class:`MappedQTensor`) as :func:`attach_saved` records it
    (rounded as ``quant`` rounds), with ``ctx`` as the producer whose saved item ``share_item`` restores the same tensor (None:
    no such item); under torch.compile (``out_packed``: dynamo keeps no Python attributes on its
    nodes) ``(y, *q.tensors())``, the packed tensors non-differentiable, for the layer's wrapper
    (:func:`output_copy`, then :func:`attach_saved`)."""
    if not out_packed:
        if type(q) is QTensor:
            box = None
            if share_item is not None:
                box = Share()
                ctx.mesa_share = (share_item, box, None)
            y._mesa_saved = (q if record is None else record, y._version, bool(quant.stochastic), box)
        return y
    packed = q.tensors() if isinstance(q, QTensor) else ()
    ctx.mark_non_differentiable(*packed)
    ctx.set_materialize_grads(False)  # (no zero gradients made for the packed outputs)
    return (y,) + packed


def output_copy(out, quant, dtype: torch.dtype):
    """(y, the :class:`QTensor` handed on with it, or None) from what :func:`hand_on` returned
    under torch.compile: rebuilt from the extra outputs (``quant``'s groups and bits, stored in
    ``dtype``)."""
    y, *packed = out
    if not packed:
        return y, None
    g, inner = quant.groups_for(y.shape)
    return y, QTensor.of(packed, y.shape, dtype, quant.bits, g, inner, False)


def saved_record(t: torch.Tensor):
    """What :func:`attach_saved` recorded on ``t`` (None if nothing): read by a layer's Python
    wrapper and passed into its autograd Function as an argument, since inside the Function's
    forward torch.compile (dynamo of torch 2.8) sees a fresh tensor without the attribute."""
    return getattr(t, "_mesa_saved", None)


def adopt_saved(ctx, t: torch.Tensor, quant, dtype: torch.dtype | None = None, derived: bool = False,
                item: int = 0, grad_input: int = 0, rec=None):
    """:func:`find_saved`, and when the copy is one its producer's backward restores too, record
    on ``ctx`` (which saves it as item ``item``) that its backward hands the restored tensor on,
    when the gradient of its input ``grad_input`` flows back to that producer (``ctx`` None:
    nothing recorded). ``rec``: ``t``'s :func:`saved_record` (read from ``t`` when None). Runs
    once per layer that takes another's copy: a derived copy is matched without a further call."""
    rec = getattr(t, "_mesa_saved", None) if rec is None else rec
    if rec is None:
        return None
    qt, version, stochastic, box = rec
    kind = type(qt)
    if kind is AffineQTensor or kind is MappedQTensor:
        base = qt[0]  # ([0]: dynamo of torch 2.8 reads no property of a NamedTuple)
        if (not derived or type(quant) is int or (version is not None and version != t._version)
                or base[3] != t.shape or base[5] != quant._bits or stochastic != bool(quant.stochastic)):
            return None
    elif not _matches(qt, version, stochastic, t, quant, dtype):
        return None
    if box is not None and ctx is not None:
        ctx.mesa_share = (item, box, grad_input)
    return qt


def _matches(qt: QTensor, version, stochastic: bool, t: torch.Tensor, quant, dtype) -> bool:
    """Whether ``qt`` (recorded on ``t`` at ``version``) stores what ``quant`` (or a bit width)
    would store of ``t``: see :func:`find_saved`."""
    if (version is not None and version != t._version) or qt.shape != t.shape:
        return False
    if dtype is not None and qt.dtype != dtype:
        return False
    if isinstance(quant, int):
        return qt.bits == quant
    if qt.bits != quant._bits or stochastic != bool(quant.stochastic):
        return False
    if (qt.transposed and quant.group_dim != "channel") or qt.transposed == CHANNELS_LAST:
        return False
    shape = list(t.shape)
    if qt.transposed:
        shape[-2], shape[-1] = shape[-1], shape[-2]
    return (qt.groups, qt.inner) == quant.groups_for(shape)


def find_saved(t: torch.Tensor, quant, dtype: torch.dtype | None = None, derived: bool = False,
               rec=None) -> QTensor | AffineQTensor | MappedQTensor | None:
    """The packed copy attached to ``t`` if the quantizer ``quant`` would store the same thing:
    ``t`` not modified in place, same shape, bits, groups (count and layout), rounding mode (and
    ``dtype`` when given). ``quant`` may also be a bit width (then only bits are compared).
    With ``derived`` a copy that restores ``t`` from another layer's packed tensor is also taken
    when bits and rounding match (a LayerNorm's x-hat with its weight and bias:
    :class:`AffineQTensor`; a GELU's input through GELU: :class:`MappedQTensor`): its groups
    are that layer's, and it restores in that layer's compute dtype (the caller casts). ``rec``:
    ``t``'s :func:`saved_record` (read from ``t`` when None)."""
    return adopt_saved(None, t, quant, dtype, derived, rec=rec)


def save_for_backward(ctx, *items, traced: bool | None = None) -> None:
    """``ctx.save_for_backward`` for a mix of packed copies (:class:`QTensor`,
    :class:`AffineQTensor`, :class:`MappedQTensor`), Tensor and None items, in a fixed layout:
    a packed copy takes 4 slots (codes, step, shift, exact prefix rows or None), an
    AffineQTensor 2 more (weight, bias), anything else 1; ``ctx.mesa_layout`` holds (kind or
    None, first slot, meta) per item. Runs once per Mesa forward: ``traced`` False (the forward
    knows it runs eagerly) sets the context's slot as torch's method would
    (:data:`~mesa_ops.compat.SAVES_TO_SLOT`), without its Python frame; dynamo follows only the
    method (``traced`` True or None)."""
    ws = getattr(_local, "ws", None)
    if ws is not None and ws.armed and _p._graph_task_id() == -1:
        ws.clear()  # a forward outside any backward: the last backward raised, elsewhere
    flat, layout = [], []
    # (meta by index, not q[3:9]: dynamo before torch 2.9 cannot slice a NamedTuple)
    for it in items:
        kind = type(it)
        if kind is QTensor:
            layout.append((QTensor, len(flat), (it[3], it[4], it[5], it[6], it[7], it[8])))
            flat += (it[0], it[1], it[2], it[9])
        elif kind is AffineQTensor:
            q = it[0]
            layout.append((AffineQTensor, len(flat), (q[3], q[4], q[5], q[6], q[7], q[8])))
            flat += (q[0], q[1], q[2], q[9], it[1], it[2])
        elif kind is MappedQTensor:
            q = it[0]
            layout.append((MappedQTensor, len(flat), (q[3], q[4], q[5], q[6], q[7], q[8], it[1])))
            flat += (q[0], q[1], q[2], q[9])
        else:
            layout.append((None, len(flat), None))
            flat.append(it)
    if traced is False and SAVES_TO_SLOT:
        ctx.to_save = tuple(flat)
    else:
        ctx.save_for_backward(*flat)
    ctx.mesa_layout = layout


def saved_tensors(ctx, split_affine: bool = False, together: int = 0, traced: bool | None = None,
                  heads: int = 0, head_items: int = 0) -> list:
    """The items given to :func:`save_for_backward`, packed copies restored. With
    ``split_affine`` an :class:`AffineQTensor` comes back as the tuple (x-hat restored, weight,
    bias) instead of x-hat * weight + bias (for a backward that folds the affine map into a
    smaller tensor). An item shared with another backward (:class:`Share`) is restored once.
    The QTensors among the first ``together`` items (an attention's q, k, v) are restored by
    one call where the backend has one (:meth:`QTensor.restore_many`). The packed copies among
    the first ``head_items`` come back as ``heads`` (B, H, L, D) heads of their (B, L, H * D)
    token layout (an attention's q, k, v and output). ``traced``: torch.compile traces this
    backward (as its forward knew; None to ask): restored by the registered ops."""
    if traced is None:
        traced = compiling()
    flat = ctx.saved_tensors
    # (not while torch.compile traces: the compiled backward runs no Python; the log drains itself)
    if not traced and (nonfinite.LOG.pending or nonfinite.LOG.in_flight):
        nonfinite.on_backward()
    share = getattr(ctx, "mesa_share", None)
    # a backward that records no graph (create_graph=False): workspace buffers, shared copies
    ws = not traced and not torch.is_grad_enabled() and _p._graph_task_id() != -1
    layout = ctx.mesa_layout
    early = _restored_together(flat, layout, together, share, traced, heads if together <= head_items else 0) \
        if together else None
    out = []
    for j, (kind, i, meta) in enumerate(layout):
        if kind is None:
            out.append(flat[i])
        elif early is not None and j in early:
            out.append(early[j])
        elif share is not None and j == share[0] and (
                kind is QTensor or (split_affine and kind is AffineQTensor)):
            # (read-only: never modified) taken from the box when the other backward left it
            # there; else restored, and left there (in a backward that records no graph) by a
            # consumer whose input gradient flows on to the producer (whose backward then runs
            # and takes it)
            box, grad_input = share[1], share[2]
            x = box.t
            if x is not None:
                if grad_input is None:  # the producer: the last user; its release() frees it
                    box.t = None
                    x._mesa_boxed = False
            else:
                x = restore(flat[i], flat[i + 1], flat[i + 2], flat[i + 3], meta, traced, ws)
                if ws and grad_input is not None and ctx.needs_input_grad[grad_input]:
                    box.t = x
                    x._mesa_boxed = True
            if j < head_items:
                x = split_heads(x, heads)
            out.append(x if kind is QTensor else (x, flat[i + 4], flat[i + 5]))
        elif kind is QTensor:
            out.append(restore(flat[i], flat[i + 1], flat[i + 2], flat[i + 3], meta, traced, ws,
                               heads if j < head_items else 0))
        elif kind is AffineQTensor:
            x = restore(flat[i], flat[i + 1], flat[i + 2], flat[i + 3], meta, traced, ws)
            out.append((x, flat[i + 4], flat[i + 5]) if split_affine else _affine(x, flat[i + 4], flat[i + 5]))
        else:
            out.append(MappedQTensor.restore(flat[i:i + 4], meta, traced))
    return out


def _restored_together(flat, layout, together: int, share, traced: bool, heads: int):
    """{item: restored tensor} of the QTensors among the first ``together`` items, restored by
    one call (:meth:`QTensor.restore_many`), or None where their backend makes one call each."""
    many = [j for j in range(min(together, len(layout))) if layout[j][0] is QTensor
            and not (share is not None and j == share[0])]
    if traced or len(many) < 2:
        return None
    first = layout[many[0]]
    if not getattr(restorer(flat[first[1]], first[2][1], first[2][2]), "has_many", False):
        return None
    done = QTensor.restore_many([(flat[layout[j][1]:layout[j][1] + 4], layout[j][2]) for j in many], traced)
    return dict(zip(many, [split_heads(t, heads) for t in done] if heads else done))


def saved_packed(ctx) -> list:
    """The items given to :func:`save_for_backward` as they were: QTensors packed (for a
    backward that reads its stored tensor through a table, without dequantizing it)."""
    flat = ctx.saved_tensors
    traced = getattr(ctx, "traced", None)  # (as the forward knew it; the log is not read while tracing)
    if not (compiling() if traced is None else traced) and (nonfinite.LOG.pending or nonfinite.LOG.in_flight):
        nonfinite.on_backward()
    out = []
    for kind, i, meta in ctx.mesa_layout:
        if kind is None:
            out.append(flat[i])
        elif kind is QTensor:
            out.append(_tnew(QTensor, (flat[i], flat[i + 1], flat[i + 2]) + meta + (flat[i + 3],)))
        else:
            raise ValueError(f"mesa saved_packed: a {kind.__name__} has no packed form here")
    return out
