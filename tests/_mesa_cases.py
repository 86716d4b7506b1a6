"""Layer cases shared by test_layers.py, test_shared_copies.py and test_amp.py: each Mesa layer,
its plain ``nn`` counterpart holding the same weights, input shapes, and byte-count helpers."""
from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn

import mesa_ops as ms


class PlainMatMul(nn.Module):
    """The ``nn`` counterpart of ms.MatMul."""

    def forward(self, a, b):
        return torch.matmul(a, b)


class PlainNormalize(nn.Module):
    """The ``nn`` counterpart of ms.Normalize (F.normalize along the last dim)."""

    def forward(self, x):
        return torch.nn.functional.normalize(x, dim=-1)


class PlainScale(nn.Module):
    """The ``nn`` counterpart of ms.Scale."""

    def forward(self, x, s):
        return x * s


# name -> (plain layer factory, Mesa layer factory, input shapes)
CASES = {
    "Linear": (lambda: nn.Linear(64, 48), lambda: ms.Linear(64, 48), [(8, 16, 64)]),
    "Conv2d": (lambda: nn.Conv2d(8, 12, 3, padding=1), lambda: ms.Conv2d(8, 12, 3, padding=1),
               [(4, 8, 10, 10)]),
    "LayerNorm": (lambda: nn.LayerNorm(64), lambda: ms.LayerNorm(64), [(8, 16, 64)]),
    "GELU": (lambda: nn.GELU(), lambda: ms.GELU(), [(8, 16, 64)]),
    "Softmax": (lambda: nn.Softmax(dim=-1), lambda: ms.Softmax(dim=-1), [(2, 4, 16, 16)]),
    "MatMul": (PlainMatMul, ms.MatMul, [(2, 4, 16, 8), (2, 4, 8, 16)]),
    "BatchNorm2d": (lambda: nn.BatchNorm2d(32), lambda: ms.BatchNorm2d(32), [(4, 32, 6, 6)]),
    "ReLU": (lambda: nn.ReLU(), lambda: ms.ReLU(), [(8, 16, 64)]),
    # cosine attention: q (B, H, N, D) normalized over D; attn (B, H, N, N) times a per-head scale
    "Normalize": (PlainNormalize, ms.Normalize, [(2, 4, 16, 16)]),
    "Scale": (PlainScale, ms.Scale, [(4, 12, 16, 16), (12, 1, 1)]),
}
NAMES = list(CASES)


def randomize_affine(m: nn.Module) -> None:
    """Norm layers start at weight 1 / bias 0; give them generic values so that a wrong weight
    or bias gradient cannot hide behind the init."""
    with torch.no_grad():
        for name, p in m.named_parameters(recurse=False):
            if isinstance(m, (nn.LayerNorm, nn.BatchNorm2d)):
                p.copy_(torch.rand_like(p) + 0.5 if name == "weight" else torch.randn_like(p))


def make_pair(name: str, plain=None, mesa=None):
    """(plain layer, Mesa layer) with identical parameters (separate tensors), train mode."""
    plain_f, mesa_f, shapes = CASES[name]
    m = (mesa or mesa_f)()
    randomize_affine(m)
    p = (plain or plain_f)()
    own = p.state_dict()
    p.load_state_dict({k: v.clone() for k, v in m.state_dict().items() if k in own})
    m.train()
    p.train()
    return p, m, shapes


def inputs(shapes, dist: str = "uniform", dtype=torch.float32, device="cpu"):
    """Inputs drawn U[-1, 1) ('uniform') or N(0, 1) ('gauss')."""
    if dist == "uniform":
        return [(torch.rand(s, device=device) * 2 - 1).to(dtype) for s in shapes]
    return [torch.randn(s, device=device).to(dtype) for s in shapes]


def run(layer: nn.Module, xs, gy=None):
    """Forward on leaf copies of ``xs``, backward of ``gy`` (drawn N(0,1) when None); returns
    (output, gy, {grad name: grad}) with names x0, x1, ... and the parameter names."""
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    y = layer(*leaves)
    if gy is None:
        gy = torch.randn(y.shape, device=y.device).to(y.dtype)
    y.backward(gy)
    grads = {f"x{i}": x.grad for i, x in enumerate(leaves)}
    grads.update({n: p.grad for n, p in layer.named_parameters()})
    return y, gy, grads


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """norm(a - b) / norm(b), in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def clone_layer(m):
    return copy.deepcopy(m)


def enable_mesa(layer, bits=8, **settings):
    """Turn compression on at ``bits`` for every Mesa layer of ``layer`` (at least one)."""
    n = ms.policy.set_mesa(layer, True, bits, **settings)
    assert n >= 1
    return layer


def code_bytes(numel, bits):
    """Bytes of ``numel`` packed codes at ``bits`` bits."""
    return math.ceil(numel * bits / 8)


def meter_bytes(layer, xs, requires_grad=True):
    """(bytes autograd saves for one forward of ``layer`` on copies of ``xs``, the output)."""
    leaves = [x.detach().clone().requires_grad_(requires_grad) for x in xs]
    with ms.SavedActivationMeter(layer) as meter:
        y = layer(*leaves)
    return meter.total_bytes, y


def unique_bytes(*tensors):
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def scale_bytes(groups):
    """Bytes of the per-group fp32 step and shift a packed copy keeps besides its codes (the
    quantizer may keep them as rows of one small (k, G) float32 tensor, in the codes' own
    allocation or apart): 'tiny', at most 16 bytes per group."""
    qt = ms.Quantizer(groups, enable=True).quantize(torch.randn(2, 3, groups))
    nbytes = unique_bytes(qt.packed, qt.step, qt.shift) - qt.packed.numel()
    assert 8 * groups <= nbytes <= 16 * groups, nbytes
    return nbytes
