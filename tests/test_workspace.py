"""The backward workspace (reused CPU buffers for dequantized activations) changes no result,
and MatMul honours each quantizer's own ``enable``."""
import torch

import mesa_ops as ms
from mesa_ops.blocks import Block


def _grads(backend, monkeypatch, steps=3):
    if backend:
        monkeypatch.setenv("MESA_BACKEND", backend)
    else:
        monkeypatch.delenv("MESA_BACKEND", raising=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(48, 3), Block(48, 3))
    ms.policy.set_mesa(model, True, 8)
    out = []
    for s in range(steps):
        x = torch.randn(2, 9, 48, generator=torch.Generator().manual_seed(s))
        for p in model.parameters():
            p.grad = None
        model(x).square().sum().backward()
        out.append([p.grad.clone() for p in model.parameters()])
    return out


def test_workspace_gives_the_reference_gradients_bit_for_bit(monkeypatch):
    cpp = _grads(None, monkeypatch)       # C++ kernels, dequantized into workspace buffers
    ref = _grads("torch", monkeypatch)    # pure-PyTorch reference, fresh tensors
    for step_cpp, step_ref in zip(cpp, ref):
        for a, b in zip(step_cpp, step_ref):
            assert torch.equal(a, b)


def test_workspace_is_empty_after_backward():
    from mesa_ops import packed

    m = ms.Linear(16, 16, enable=True)
    m(torch.randn(4, 16, requires_grad=True)).sum().backward()
    ws = packed._workspace()
    assert ws.free == {} and ws.count == 0 and not ws.armed


def test_matmul_stores_exactly_the_input_whose_quantizer_is_off():
    mm = ms.MatMul(quant_groups=3, enable=True)
    mm.quant2.enable = False
    a = torch.randn(2, 3, 4, 5, requires_grad=True)
    b = torch.randn(2, 3, 5, 4, requires_grad=True)
    with ms.SavedActivationMeter(mm) as meter:
        y = mm(a, b)
    packed_a = a.numel()  # 8-bit codes
    exact_b = b.numel() * 4
    assert packed_a + exact_b <= meter.total_bytes <= packed_a + exact_b + 64
    y.sum().backward()
    g = torch.ones(2, 3, 4, 4)
    # b was stored exactly, so a's gradient g @ b^T is exact; b's uses the 8-bit copy of a
    assert torch.allclose(a.grad, g.matmul(b.detach().transpose(-2, -1)), rtol=0, atol=1e-6)
    exact_gb = a.detach().transpose(-2, -1).matmul(g)
    assert 0 < (b.grad - exact_gb).norm() / exact_gb.norm() < 2e-2
