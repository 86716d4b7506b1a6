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


def test_every_workspace_buffer_is_handed_back(monkeypatch):
    """In a backward through Mesa blocks (LayerNorm, Linear, SDPA, GELU) every buffer taken
    from the workspace is released after its last use (SDPA's restored q, k, v and output
    included), so later restores reuse them instead of allocating. (The workspace takes CPU
    tensors from WORKSPACE_MIN_BYTES up: here every size.)"""
    from mesa_ops import packed

    monkeypatch.delenv("MESA_BACKEND", raising=False)
    monkeypatch.setattr(packed, "WORKSPACE_MIN_BYTES", 0)
    taken, given = [], []
    acquire, release = packed._Workspace.acquire, packed._Workspace.release

    def counting_acquire(self, numel, dtype, device):
        out = acquire(self, numel, dtype, device)
        taken.append(out[1])
        return out

    def counting_release(self, buf):
        given.append(buf)
        release(self, buf)

    monkeypatch.setattr(packed._Workspace, "acquire", counting_acquire)
    monkeypatch.setattr(packed._Workspace, "release", counting_release)
    from models.deit import Block as DeiTBlock  # attention on ms.SDPA

    torch.manual_seed(0)
    model = torch.nn.Sequential(DeiTBlock(48, 3, qkv_bias=True), DeiTBlock(48, 3, qkv_bias=True))
    ms.policy.set_mesa(model, True, 8)
    assert any(isinstance(m, ms.SDPA) for m in model.modules())
    model(torch.randn(2, 9, 48, requires_grad=True)).square().sum().backward()
    assert len(taken) >= 14  # per block: 2 x-hats, q, k, v, out, the GELU output
    assert sorted(map(id, given)) == sorted(map(id, taken))
    fresh = {id(b) for b in taken}
    assert len(fresh) < len(taken)  # buffers were reused


def test_small_restores_take_no_workspace_buffer(monkeypatch):
    """Below WORKSPACE_MIN_BYTES (no page faults to save) a backward's restored tensors are
    plain allocations: the workspace is never armed, and the gradients are the same bits as
    with every restore in the workspace."""
    from mesa_ops import packed

    monkeypatch.delenv("MESA_BACKEND", raising=False)
    taken = []
    acquire = packed._Workspace.acquire
    monkeypatch.setattr(packed._Workspace, "acquire",
                        lambda self, *a: taken.append(a) or acquire(self, *a))
    x = torch.randn(2, 9, 48)
    assert x.numel() * 4 < packed.WORKSPACE_MIN_BYTES
    small = _grads(None, monkeypatch, steps=2)
    assert taken == []
    monkeypatch.setattr(packed, "WORKSPACE_MIN_BYTES", 0)
    every = _grads(None, monkeypatch, steps=2)
    assert taken
    for a, b in zip(small, every):
        assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_a_transposed_copy_hands_its_workspace_buffer_back(monkeypatch):
    """A copy stored in transposed order (k^T of an explicit attention's q @ k^T, a transposed view
    of k) is restored into a workspace buffer as a view of it, which carries the buffer, so that
    the consumer's release hands it back (the same for a conv's channels-last input)."""
    from mesa_ops import packed

    monkeypatch.delenv("MESA_BACKEND", raising=False)
    monkeypatch.setattr(packed, "WORKSPACE_MIN_BYTES", 0)
    taken, given = [], []
    acquire, release = packed._Workspace.acquire, packed._Workspace.release
    monkeypatch.setattr(packed._Workspace, "acquire",
                        lambda self, *a: (lambda out: taken.append(out[1]) or out)(acquire(self, *a)))
    monkeypatch.setattr(packed._Workspace, "release", lambda self, buf: given.append(buf) or release(self, buf))
    mm = ms.MatMul(quant_groups=3, enable=True)
    q = torch.randn(2, 3, 4, 5, requires_grad=True)
    k = torch.randn(2, 3, 4, 5, requires_grad=True)
    mm(q, k.transpose(-2, -1)).square().sum().backward()
    conv = ms.Conv2d(3, 6, 3, padding=1, quant_groups=3, enable=True).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last).requires_grad_()
    conv(x).square().sum().backward()
    assert len(taken) >= 2
    assert sorted(map(id, given)) == sorted(map(id, taken))
