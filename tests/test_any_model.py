"""Issue 35: any model is either handled correctly or told what stayed exact. Item 3: group
counts are valid by construction (a head count that does not divide a layer's channels gives the
largest divisor below it, said in the report), so compress's success is never followed by a
crash in the first training step."""
from __future__ import annotations

import copy

import timm
import torch

import mesa_ops as ms


def test_heads_that_do_not_divide_the_mlp_width_get_a_divisor_and_are_reported():
    """vit_little_patch16_reg4_gap_256: 5 heads, MLP width 1792 (= 2^8 * 7): before, compress
    reported success and the first training forward raised 'quant_groups=5 does not divide'."""
    torch.manual_seed(0)
    model = timm.create_model("vit_little_patch16_reg4_gap_256", img_size=32, depth=2)
    ref = copy.deepcopy(model).train()
    model, report = ms.compress(model, "mesa8", return_report=True, warn=False)
    changed = {n: (a, c, g) for n, a, c, g in report.groups}
    assert changed == {f"blocks.{i}.mlp.{m}": (5, 1792, 4) for i in range(2) for m in ("act", "fc2")}
    assert model.blocks[0].mlp.fc2.quant_groups == 4 and model.blocks[0].mlp.fc1.quant_groups == 5
    assert "5 groups do not divide 1792 channels: 4" in report.summary()
    x = torch.randn(2, 3, 32, 32)
    model.train()
    y = model(x)
    assert torch.allclose(y, ref(x), atol=1e-5)
    y.square().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_divisible_models_report_no_group_change():
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, depth=1)
    _, report = ms.compress(model, "mesa8", return_report=True, warn=False)
    assert report.groups == [] and "groups changed" not in report.summary()
