"""Core correctness (issue 12 items 1, 3-7; issue 10 item 5) and the cross-rank range sync:
double backward, group dim by layer kind, frozen weights, Mesa's own RNG stream, non-finite
activations under fp16 autocast, softmax -> attn@v reuse conditions, quantizer settings living
with the quantizer, dist_sync on two gloo ranks."""
from __future__ import annotations

import ast
import copy
import os
import warnings

import pytest
import torch
import torch.nn as nn

import mesa_ops as ms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mlp(dim=12, hidden=24, groups=3):
    torch.manual_seed(0)
    m = nn.Sequential(ms.Linear(dim, hidden, quant_groups=groups), ms.GELU(quant_groups=groups),
                      ms.Linear(hidden, hidden, quant_groups=groups), ms.GELU(quant_groups=groups),
                      ms.Linear(hidden, 4, quant_groups=groups))
    ms.policy.set_mesa(m, True, 8)
    return m.train()


# ---- item 1: double backward ---------------------------------------------------------------
def _first_order(model, x, create_graph):
    xx = x.clone().requires_grad_()
    params = list(model.parameters())
    grads = torch.autograd.grad(model(xx).square().sum(), [xx] + params, create_graph=create_graph)
    return grads


def test_gradient_penalty_through_compressed_layers_raises_clearly():
    model = _mlp()
    x = torch.randn(6, 5, 12)
    xx = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(model(xx).square().sum(), xx, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward through the Mesa layer"):
        gx.square().sum().backward()
    # exact layers (compression off) still give the true second-order gradient
    ms.policy.set_mesa(model, enable=False)
    (gx,) = torch.autograd.grad(model(xx).square().sum(), xx, create_graph=True)
    gx.square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_create_graph_first_order_gradients_are_those_without_it(monkeypatch, backend):
    """create_graph=True records no graph through Mesa's backward and takes no workspace buffer
    a graph could hold: the first-order gradients are bit for bit those of a plain backward, on
    both backends (which agree with each other)."""
    monkeypatch.setenv("MESA_BACKEND", backend)
    model = _mlp()
    x = torch.randn(6, 5, 12)
    plain = _first_order(copy.deepcopy(model), x, create_graph=False)
    graph = _first_order(copy.deepcopy(model), x, create_graph=True)
    for a, b in zip(plain, graph):
        assert torch.equal(a, b)


def test_backends_agree_under_create_graph(monkeypatch):
    res = {}
    for backend in ("torch", "cpp"):
        monkeypatch.setenv("MESA_BACKEND", backend)
        res[backend] = _first_order(_mlp(), torch.randn(6, 5, 12, generator=torch.Generator().manual_seed(1)),
                                    create_graph=True)
    for a, b in zip(res["torch"], res["cpp"]):
        assert torch.equal(a, b)


# ---- item 3: group dim by layer kind -------------------------------------------------------
def _group_ranges(x, dim, groups):
    xs = x.movedim(dim, -1)
    v = xs.reshape(-1, groups, xs.shape[-1] // groups)
    return v.amax(dim=(0, 2)) - v.amin(dim=(0, 2)), v.amin(dim=(0, 2))


@pytest.mark.parametrize("layer", ["Linear", "LayerNorm", "GELU"])
def test_channels_last_tokens_group_over_the_last_dim(layer):
    """(B, H, W, C) tokens with G = 3 not dividing H = 5: groups run over C."""
    C, G = 6, 3
    m = {"Linear": lambda: ms.Linear(C, 4, quant_groups=G),
         "LayerNorm": lambda: ms.LayerNorm(C, quant_groups=G),
         "GELU": lambda: ms.GELU(quant_groups=G)}[layer]()
    m.enable = True
    x = torch.randn(2, 5, 4, C, requires_grad=True)
    m(x).sum().backward()
    stored = x.detach()
    if layer == "LayerNorm":  # it stores x-hat = (x - mean) * rstd
        _, mean, rstd = torch.native_layer_norm(stored, (C,), None, None, m.eps)
        stored = (stored - mean) * rstd
    rng, lo = _group_ranges(stored, -1, G)
    torch.testing.assert_close(m.clip_val, rng, rtol=0, atol=0)
    torch.testing.assert_close(m.shift, lo, rtol=0, atol=0)


def test_maps_and_attention_tensors_group_over_dim_1():
    conv = ms.Conv2d(6, 4, 3, quant_groups=3, enable=True)
    x = torch.randn(2, 6, 5, 5, requires_grad=True)
    conv(x).sum().backward()
    torch.testing.assert_close(conv.clip_val, _group_ranges(x.detach(), 1, 3)[0], rtol=0, atol=0)
    sm = ms.Softmax(dim=-1, quant_groups=3, enable=True)
    s = torch.randn(2, 3, 5, 5, requires_grad=True)
    y = sm(s)
    y.sum().backward()
    torch.testing.assert_close(sm.quant2.clip_val, _group_ranges(y.detach(), 1, 3)[0], rtol=0, atol=0)


# ---- item 4: frozen weights ----------------------------------------------------------------
@pytest.mark.parametrize("kind", ["Linear", "Conv2d"])
def test_frozen_weight_stores_nothing_and_keeps_its_range(kind):
    if kind == "Linear":
        layer, x = ms.Linear(16, 8, enable=True), torch.randn(4, 7, 16, requires_grad=True)
    else:
        layer, x = ms.Conv2d(4, 6, 3, enable=True), torch.randn(2, 4, 8, 8, requires_grad=True)
    layer.weight.requires_grad_(False)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with ms.SavedActivationMeter(layer) as meter:
        y = layer(x)
    assert meter.total_bytes == 0
    y.sum().backward()
    for k, v in layer.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert x.grad is not None and layer.bias.grad is not None
    layer.weight.requires_grad_(True)  # trainable again: stored packed, range updated
    with ms.SavedActivationMeter(layer) as meter:
        layer(x)
    assert meter.total_bytes > 0 and float(layer.iteration) == 1


# ---- item 5: Mesa's own RNG stream ---------------------------------------------------------
def _dropout_net():
    torch.manual_seed(0)
    m = nn.Sequential(ms.Linear(16, 32), nn.Dropout(0.5), ms.GELU(), ms.Linear(32, 8), nn.Dropout(0.3))
    return m.train()


def test_mesa_on_and_off_draw_the_same_dropout_masks():
    x = torch.randn(4, 16, requires_grad=True)
    outs = []
    for on in (True, False):
        m = _dropout_net()
        ms.policy.set_mesa(m, enable=on)
        torch.manual_seed(5)
        outs.append(m(x))
        outs.append(torch.rand(3))  # torch's stream after the forward is the same too
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])


def _step(model, x):
    model.zero_grad()
    model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_rng_state_round_trip_and_resume(tmp_path):
    x = torch.randn(4, 16)
    m = _dropout_net()
    ms.policy.set_mesa(m, True, 4)
    _step(m, x)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": m.state_dict(), "torch": torch.get_rng_state(), "mesa": ms.get_rng_state()}, path)
    g_cont = _step(m, x)
    # resume into a fresh model: the same noise and dropout as the uninterrupted run
    ck = torch.load(path, weights_only=True)
    r = _dropout_net()
    ms.policy.set_mesa(r, True, 4)
    torch.manual_seed(123)
    r.load_state_dict(ck["model"])
    torch.set_rng_state(ck["torch"])
    ms.set_rng_state(ck["mesa"])
    for a, b in zip(g_cont, _step(r, x)):
        assert torch.equal(a, b)
    # another Mesa base: other rounding noise (dropout unchanged)
    r.load_state_dict(ck["model"])
    torch.set_rng_state(ck["torch"])
    ms.set_rng_state(ck["mesa"] + 1)
    assert not torch.equal(g_cont[0], _step(r, x)[0])
    ms.set_rng_state(ck["mesa"])
    with pytest.raises(ValueError, match="get_rng_state"):
        ms.set_rng_state(torch.zeros(3))


# ---- item 6: non-finite activations under fp16 autocast --------------------------------------
def _amp_net():
    torch.manual_seed(0)
    m = nn.Sequential(ms.Linear(16, 32), ms.GELU(), ms.Linear(32, 4))
    ms.policy.set_mesa(m, True, 8)
    return m.train()


def test_nonfinite_under_fp16_autocast_lets_gradscaler_skip_the_step():
    m = _amp_net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.float16):  # a finite step first: ranges start
        scaler.scale(m(x).float().sum()).backward()
    scaler.step(opt)
    scaler.update()
    params = [p.detach().clone() for p in m.parameters()]
    state = {k: v.clone() for k, v in m.state_dict().items()}
    x[1, 3] = float("inf")
    opt.zero_grad()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with torch.autocast("cpu", dtype=torch.float16):
            loss = m(x).float().sum()
            m(x)  # a second step: no second warning
    msgs = [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)]
    # once per layer that stores a copy the Inf reaches (Linear '0', GELU '1'; Linear '2' reuses
    # the GELU's packed input), not again on step two
    assert float(m[2].iteration) == 0
    assert len(msgs) == 2 and all(f"'{i}'" in m and "NaN or Inf" in m for i, m in enumerate(msgs)), msgs
    scaler.scale(loss).backward()
    assert not torch.isfinite(m[0].weight.grad).all()  # non-finite, as in exact training
    scaler.step(opt)  # skipped
    scaler.update()
    for p, p0 in zip(m.parameters(), params):
        assert torch.equal(p, p0)
    assert torch.equal(m[0].clip_val, state["0.clip_val"])
    assert torch.equal(m[0].iteration, state["0.iteration"])


def test_nonfinite_outside_autocast_raises_and_raise_mode_under_autocast():
    m = _amp_net()
    x = torch.randn(4, 16)
    x[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="'0'"):
        m(x)
    m[0].nonfinite = "raise"
    with pytest.raises(FloatingPointError, match="'0'"), torch.autocast("cpu", dtype=torch.float16):
        m(x)
    with pytest.raises(ValueError, match="nonfinite"):
        m[0].nonfinite = "ignore"


def test_nonfinite_policy_key(tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("on fc:\n    by_index: all\n    enable: True\n    nonfinite: skip\n    dist_sync: False\n")
    m = _amp_net()
    ms.policy.deploy_on_init(m, str(p), verbose=lambda *_: None)
    assert m[0].nonfinite == "skip" and m[0].dist_sync is False and m[1].nonfinite == "auto"
    p.write_text("on fc:\n    by_index: all\n    nonfinite: sometimes\n")
    with pytest.raises(ms.policy.PolicyError, match="nonfinite"):
        ms.policy.deploy_on_init(m, str(p), verbose=lambda *_: None)


# ---- item 7: softmax -> attn @ v reuse conditions -------------------------------------------
@pytest.mark.parametrize("change", [None, "groups", "rounding", "bits"])
def test_softmax_copy_reused_only_when_stored_the_same_way(change):
    sm, mm = ms.Softmax(dim=-1, quant_groups=4, enable=True), ms.MatMul(quant_groups=4, enable=True)
    if change == "groups":
        mm.quant1.quant_groups = 2
        mm.quant1.clip_val, mm.quant1.shift = torch.ones(2), torch.zeros(2)
    elif change == "rounding":
        mm.quant1.stochastic = False
    elif change == "bits":
        mm.quant1.bits = 4
    s = torch.randn(2, 4, 8, 8, requires_grad=True)
    v = torch.randn(2, 4, 8, 6, requires_grad=True)
    with ms.SavedActivationMeter() as meter:
        y = mm(sm(s), v)
    reused = float(mm.quant1.iteration) == 0
    assert reused == (change is None)
    attn_bytes = 2 * 4 * 8 * 8
    own = 0 if change is None else attn_bytes * (mm.quant1.bits / 8)
    low = attn_bytes + own + v.numel()
    assert low <= meter.total_bytes <= low + 3 * 64  # + the (4, G) scales of each copy
    y.sum().backward()
    assert torch.isfinite(s.grad).all()


# ---- issue 10 item 5: the quantizer owns its settings ----------------------------------------
def _imports(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names.add((node.module or "") + ":" + ",".join(a.name for a in node.names))
    return names


def test_layers_and_policy_do_not_import_each_other():
    assert not any("policy" in n for n in _imports("mesa_ops/layers.py"))
    assert not any("policy" in n for n in _imports("mesa_ops/quant.py"))
    assert ms.policy.update_quantization_parameter is ms.quant.update_quantization_parameter
    m = ms.Linear(4, 4)
    m.update_quantization_parameter(by_index="all", enable=True, bits=4)
    assert m.enable and m.bits == 4


# ---- dist_sync: identical running ranges on every rank ---------------------------------------
def _dist_worker(rank, world, tmp):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    out = {}
    for sync in (True, False):
        torch.manual_seed(0)
        layer = ms.Linear(8, 4, quant_groups=2, enable=True)
        assert ms.set_dist_sync(layer, sync) == 1
        gen = torch.Generator().manual_seed(100 + rank)  # different data per rank
        for _ in range(3):
            x = (torch.randn(5, 8, generator=gen) * (1 + rank)).requires_grad_()
            layer(x).sum().backward()
        out[sync] = torch.cat([layer.clip_val, layer.shift])
    torch.save(out, f"{tmp}/rank{rank}.pt")
    dist.destroy_process_group()


def test_dist_sync_keeps_ranks_identical(tmp_path):
    import torch.multiprocessing as mp

    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    mp.spawn(_dist_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    assert torch.equal(r0[True], r1[True])
    assert not torch.equal(r0[False], r1[False])
    m = nn.Sequential(ms.Linear(4, 4), ms.MatMul())
    assert ms.set_dist_sync(m, False) == 3 and m[1].quant2.dist_sync is False
