"""Issue 35 item 6: LoRA fine-tuning (peft on a timm ViT) through ``ms.compress``: the frozen
base Linears store nothing, each adapter's A reuses the copy the layer before stored (a
LayerNorm's x-hat, the attention output, a GELU's input), only B's (B, N, r) input is stored in
addition; the forward is bit-identical and the adapters' gradients are close to exact."""
from __future__ import annotations

import copy

import pytest
import timm
import torch

import mesa_ops as ms

peft = pytest.importorskip("peft")

TARGETS = ["qkv", "proj", "fc1", "fc2"]
TARGET_RE = r".*\.(attn\.(qkv|proj)|mlp\.(fc1|fc2))"  # (not patch_embed.proj, a conv)
B_, N_, R_ = 4, 17, 4  # batch, tokens (16 patches + class token), LoRA rank


def _vit():
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2)


def _lora_vit():
    model = peft.get_peft_model(_vit(), peft.LoraConfig(r=R_, lora_alpha=R_, target_modules=TARGET_RE,
                                                        modules_to_save=["head"]))
    with torch.no_grad():  # B starts at zero (peft's init): give it values so that A gets a gradient
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model


def _step(model, x, amp: bool, input_grad: bool = False):
    model.train()
    x = x.detach().requires_grad_(input_grad)
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        with ms.SavedActivationMeter(model) as meter:
            y = model(x)
    y.float().square().mean().backward()
    return y, meter


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16-autocast"])
def test_lora_through_compress(amp):
    ref = _lora_vit()
    mesa, report = ms.compress(copy.deepcopy(ref), "mesa8", return_report=True, warn=False)
    assert report.unsupported == [] and report.lora == 2 * len(TARGETS)
    assert "8 LoRA layers" in report.summary()
    x = torch.randn(B_, 3, 32, 32)
    y0, _ = _step(ref, x, amp)
    y1, meter = _step(mesa, x, amp)
    assert torch.equal(y1, y0)
    trained = [n for n, p in ref.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n or "head" in n for n in trained)
    p0, p1 = dict(ref.named_parameters()), dict(mesa.named_parameters())
    for n in p0:
        assert (p0[n].grad is None) == (p1[n].grad is None) == (n not in trained), n
    g0 = torch.cat([p0[n].grad.flatten() for n in trained])
    g1 = torch.cat([p1[n].grad.flatten() for n in trained])
    assert float((g1 - g0).norm() / g0.norm()) < 0.02
    for n in trained:  # each adapter's gradient, A's included (B is non-zero)
        err = float((p1[n].grad - p0[n].grad).norm() / p0[n].grad.norm())
        assert err < 0.05, (n, err)

    # what each adapter stores: B its (B, N, r) input; A nothing (the copy the layer before
    # stored), except the first block's qkv A: nothing before it takes a gradient (frozen), so
    # its input, norm1's output, was stored by nobody else
    per_b = B_ * N_ * R_ + 128 + 4 * B_ * R_  # 8-bit codes, ranges, the exact class-token row
    one_copy = B_ * N_ * 192  # 8-bit codes of a (B, N, 192) input
    stored = {n: meter.by_name.get(n, 0) for n, _ in mesa.named_modules()}
    for n, b in stored.items():
        if ".lora_B." in n:
            assert 0 < b <= per_b, (n, b)
        elif ".lora_A." in n:
            first = n.startswith("base_model.model.blocks.0.attn.qkv.")
            assert (one_copy <= b <= 1.3 * one_copy) if first else b == 0, (n, b)
        elif n.endswith(".base_layer"):
            assert b == 0, (n, b)
    assert meter.weight_cast_bytes == 0 or amp


def test_frozen_weight_casts_are_not_activations():
    """Under autocast a frozen Linear's weight is cast on every forward (no autograd node: no
    gradient) and saved for its input gradient: counted with the casts, not as an activation."""
    lin = torch.nn.Linear(16, 32).requires_grad_(False)
    x = torch.randn(8, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with ms.SavedActivationMeter(lin) as meter:
            lin(x)
    assert meter.total_bytes == 0 and meter.weight_cast_bytes == 32 * 16 * 2


def test_benchmark_lora_configuration_builds_and_steps():
    """tools/benchmark.py --lora RANK: peft on this repo's model, then the mode (dry run)."""
    from benchmarks import models as B

    for mode in ("exact", "mesa8", "ckpt"):
        rec = B.dry_run(B.Config("deit_tiny_patch16_224", mode, 2, 32, lora=4, optimizer="adamw"))
        assert rec.dry_run and rec.model == "deit_tiny_patch16_224 LoRA-4"
    model, _ = B.build(B.Config("deit_tiny_patch16_224", "mesa8", 2, 32, lora=4))
    assert sum(p.requires_grad for p in model.parameters()) == 2 * 4 * 12 + 2  # A, B; head
    lora_a = model.base_model.model.blocks[0].attn.proj.lora_A["default"]
    assert lora_a.enable and lora_a.quant_groups == 3  # the base layer's groups (heads)
