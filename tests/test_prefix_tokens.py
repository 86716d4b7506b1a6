"""Issue 22.8: the class / distillation token rows of stored token tensors are kept exactly
(``prefix_tokens``); one range per channel group over all tokens stored them badly."""
from __future__ import annotations

import pytest
import timm
import torch

import mesa_ops as ms
import models
from mesa_ops.checkpoint import input_quantizer


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _tokens(B=2, N=9, C=32, seed=0):
    """(B, N, C) tokens: patch tokens of scale 3, a class token of scale 0.05 (as a trained
    ViT's residual stream: the class token lies far inside the patch tokens' range)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, C, generator=g) * 3
    x[:, 0] = torch.randn(B, C, generator=g) * 0.05
    return x


def _class_row_grads(make, prefix: int, x=None, seed=1):
    """Parameter gradients (and the input's) of a loss on the class-token row of ``make()``'s
    output only, with Mesa on (``prefix``) and off."""
    x = _tokens() if x is None else x
    r = torch.randn(x.shape[0], x.shape[-1], generator=torch.Generator().manual_seed(seed))
    out = {}
    for on in (False, True):
        torch.manual_seed(0)
        layer = make().train()
        ms.policy.set_mesa(layer, enable=on)
        ms.set_prefix_tokens(layer, prefix)
        xi = x.clone().requires_grad_()
        y = layer(xi)
        (y[:, 0] * r[:, :y.shape[-1]]).sum().backward()
        out[on] = torch.cat([xi.grad.flatten()] + [p.grad.flatten() for p in layer.parameters()])
    return rel_err(out[True], out[False])


LAYERS = {
    "linear": lambda: ms.Linear(32, 32, quant_groups=4, enable=True),
    # the LayerNorm's packed x-hat is what the Linear after it adopts (AffineQTensor, split)
    "layernorm+linear": lambda: torch.nn.Sequential(ms.LayerNorm(32, quant_groups=4, enable=True),
                                                   ms.Linear(32, 16, quant_groups=4, enable=True)),
    # the GELU's packed input is what the Linear after it restores through GELU (MappedQTensor)
    "linear+gelu+linear": lambda: torch.nn.Sequential(ms.Linear(32, 32, quant_groups=4, enable=True),
                                                      ms.GELU(quant_groups=4, enable=True),
                                                      ms.Linear(32, 16, quant_groups=4, enable=True)),
}


@pytest.mark.parametrize("kind", LAYERS)
def test_class_token_row_gradients_are_exact_with_prefix_tokens(kind):
    """A loss on the class-token output row only: its gradients read the stored class-token row
    (and, through a LayerNorm, only its statistics), so with the row kept exactly they equal
    exact autograd's; stored with the patch tokens' range they carry a large error."""
    before = _class_row_grads(LAYERS[kind], 0)
    after = _class_row_grads(LAYERS[kind], 1)
    assert before > 1e-3, before  # (measured: 0.16 linear, 0.0044 layernorm, 0.071 gelu)
    assert after < 1e-6, (kind, before, after)


def test_quantizer_keeps_the_prefix_rows_exactly_in_every_layout():
    q = ms.Quantizer(4, enable=True)
    q.prefix_tokens = 2
    x = _tokens(N=7)
    qt = q.quantize(x)
    assert qt.head is not None and qt.head.shape == (2, 2, 32)
    back = qt.dequantize()
    assert torch.equal(back[:, :2], x[:, :2])
    assert rel_err(back[:, 2:], x[:, 2:]) < 2e-2
    # (B, H, N, D) heads: dim -2 is the token dim; a transposed view (k^T) is stored as it is
    x4 = torch.randn(2, 4, 7, 8)
    back4 = q.quantize(x4).dequantize()
    assert torch.equal(back4[:, :, :2], x4[:, :, :2])
    # rank < 3 (pooled features) and too few rows: no head
    assert q.quantize(torch.randn(4, 32)).head is None
    assert q.quantize(torch.randn(2, 2, 32)).head is None
    q.prefix_tokens = 0
    assert q.quantize(x).head is None


def test_layernorm_head_is_the_normalized_row():
    """A LayerNorm stores x-hat: its head is the class token's normalized row."""
    x = _tokens()
    mean = x.mean(-1, keepdim=True)
    xh = (x - mean) / x.var(-1, keepdim=True, correction=0).sqrt()
    ln2 = ms.LayerNorm(32, quant_groups=4, enable=True).train()
    ln2.prefix_tokens = 1
    var, mean = torch.var_mean(x, dim=-1, keepdim=True, correction=0)
    qt = ln2.quantize(x, norm=(mean, torch.rsqrt(var)))
    torch.testing.assert_close(qt.head, xh[:, :1], rtol=1e-5, atol=1e-5)


def test_policy_key_and_matmul_second_operand():
    mm = ms.MatMul(quant_groups=2, enable=True)
    ms.set_prefix_tokens(mm, 1)
    assert mm.quant1.prefix_tokens == 1 and mm.quant2.prefix_tokens == 0  # (k^T: no token rows)
    lin = ms.Linear(8, 8, enable=True)
    lin.update_quantization_parameter(by_index="all", prefix_tokens=2)
    assert lin.prefix_tokens == 2
    with pytest.raises(ms.quant.PolicyError, match="prefix_tokens"):
        lin.update_quantization_parameter(by_index="all", prefix_tokens=-1)


@pytest.mark.parametrize("name,expect", [("deit_tiny_patch16_224", 1),
                                         ("deit_tiny_distilled_patch16_224", 2)])
def test_models_mark_their_prefix_tokens(name, expect):
    m = models.create_model(name, img_size=32, depth=2, ms_policy="mesa8")
    for n, q in m.named_modules():
        if not isinstance(q, ms.QuantMixin):
            continue
        want = expect if (n.startswith(("blocks.", "norm")) and not n.endswith(("mm1.quant2", "mm2.quant2"))) else 0
        assert q.prefix_tokens == want, n


def test_pvt_marks_its_last_stage_only():
    m = models.create_model("pvt_tiny", img_size=64, depths=(1, 1, 1, 1), ms_policy="mesa8")
    marked = {n.split(".")[0] for n, q in m.named_modules()
              if isinstance(q, ms.QuantMixin) and q.prefix_tokens}
    assert marked == {"block4", "norm"}


def test_compress_marks_a_timm_vit_prefix_tokens():
    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1, reg_tokens=2)
    ms.compress(vit, "mesa8", warn=False)
    assert vit.blocks[0].mlp.fc1.prefix_tokens == 3 and vit.norm.prefix_tokens == 3
    assert vit.patch_embed.proj.prefix_tokens == 0


def test_compressed_checkpoint_keeps_the_class_token_exactly():
    m = models.create_model("deit_tiny_patch16_224", img_size=32, patch_size=8, depth=1,
                            embed_dim=64, num_heads=2, ms_policy="mesa8")
    blk = m.blocks[0]
    x = _tokens(N=17, C=64)
    q = input_quantizer(x, 8, blk)
    assert q.prefix_tokens == 1
    back = q.quantize(x).dequantize()
    assert torch.equal(back[:, :1], x[:, :1])


def _deit_grad_error(prefix: bool, steps=3):
    """Relative error of the last step's Mesa-8 gradient against exact autograd on a small DeiT
    with the class token far inside the patch tokens' range (its init: cls_token ~ 0.02)."""
    torch.manual_seed(0)
    m = models.create_model("deit_tiny_patch16_224", img_size=32, patch_size=4, depth=2, embed_dim=64,
                            num_heads=2, num_classes=10, ms_policy="mesa8", drop_path_rate=0.).train()
    if not prefix:
        ms.set_prefix_tokens(m, 0)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 3, 32, 32, generator=gen) for _ in range(steps)]
    ys = torch.randint(0, 10, (4,), generator=gen)
    for x in xs:  # (warm the running ranges)
        m.zero_grad()
        torch.nn.functional.cross_entropy(m(x), ys).backward()
    mesa = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
    ms.policy.set_mesa(m, enable=False)
    m.zero_grad()
    torch.nn.functional.cross_entropy(m(xs[-1]), ys).backward()
    exact = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
    return rel_err(mesa, exact)


def test_deit_gradient_error_falls_with_exact_prefix_tokens():
    before, after = _deit_grad_error(False), _deit_grad_error(True)
    assert after < 0.5 * before, (before, after)


def test_original_api_conversion_marks_the_class_and_distillation_tokens():
    """ms.policy.convert_by_num_groups on a model of plain nn layers (timm's distilled DeiT: two
    prefix tokens; a model with only cls_token / dist_token parameters counts them)."""
    m = timm.create_model("deit_tiny_distilled_patch16_224", img_size=32, patch_size=8, depth=1)
    ms.policy.convert_by_num_groups(m, 3)
    assert m.blocks[0].attn.qkv.prefix_tokens == 2 and m.norm.prefix_tokens == 2
    assert m.head.prefix_tokens == 0

    class Plain(torch.nn.Module):  # the DeiT code of the original Mesa: no num_prefix_tokens
        def __init__(self):
            super().__init__()
            self.cls_token = torch.nn.Parameter(torch.zeros(1, 1, 8))
            self.blocks = torch.nn.Sequential(torch.nn.Linear(8, 8))
            self.norm = torch.nn.LayerNorm(8)
    p = ms.policy.convert_by_num_groups(Plain(), 1)
    assert p.blocks[0].prefix_tokens == 1 and p.norm.prefix_tokens == 1


def test_class_token_joining_after_the_blocks_is_not_marked():
    """CaiT (and XCiT) add the class token after ``blocks``: nothing there is a prefix token."""
    m = timm.create_model("cait_xxs24_224", img_size=32, patch_size=8, depth=1, depth_token_only=1)
    ms.policy.convert_by_num_groups(m, 1)
    assert all(q.prefix_tokens == 0 for q in m.modules() if isinstance(q, ms.QuantMixin))


def test_planner_counts_the_exact_rows_of_a_packed_checkpoint():
    """The planner's bytes of a block checkpointed at 8 bits include its input's head."""
    from mesa_ops import plan_measure, planner
    from mesa_ops.checkpoint import _checkpoint, site_prefix

    m = models.create_model("deit_tiny_distilled_patch16_224", img_size=32, patch_size=8, depth=1,
                            ms_policy="mesa8").train()
    blk = m.blocks[0]
    x = torch.randn(4, 18, 192, requires_grad=True)
    _, kept = _checkpoint(blk, (x,), 8, {})
    got = sum(t.numel() * t.element_size() for t in kept)
    info = planner.BlockInfo("blocks.0", in_bytes=x.numel() * 4,
                             head_bytes=plan_measure._head_bytes(x, site_prefix(blk)))
    assert info.head_bytes == 4 * 2 * 192 * 4
    assert got <= planner._packed_bytes(info) <= got + 1024
