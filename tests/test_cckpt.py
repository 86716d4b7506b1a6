"""mesa_ops.checkpoint: compressed activation checkpointing (the block input kept packed)."""
import pytest
import torch

import mesa_ops as ms
import models
from mesa_ops.checkpoint import CheckpointedBlock, checkpoint_block, exact_inside, wrap_blocks
from models.deit import Block
from models.pvt import Block as PVTBlock


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _grads(block, fn, x, gy):
    xl = x.detach().clone().requires_grad_()
    y = fn(xl)
    params = list(block.parameters())
    return y, torch.autograd.grad(y, [xl] + params, gy)


@pytest.mark.parametrize("mesa", [False, True])
def test_checkpoint_block_forward_exact_gradients_within_8bit_bound(mesa):
    torch.manual_seed(0)
    block = Block(64, 2, qkv_bias=True, drop_path=0.).train()
    if mesa:
        ms.policy.set_mesa(block, bits=8)
    x = torch.rand(3, 50, 64) * 2 - 1
    gy = torch.randn(3, 50, 64)
    y0, g0 = _grads(block, block, x, gy)
    y_ck, g_ck = _grads(block, lambda t: checkpoint_block(block, t), x, gy)  # bits=None: ordinary
    y8, g8 = _grads(block, lambda t: checkpoint_block(block, t, bits=8), x, gy)
    assert torch.equal(y_ck, y0) and torch.equal(y8, y0), "the forward must be the block's, bit for bit"
    if mesa:  # a checkpointed block's Mesa layers store exactly (exact_inside): compare with exact
        with exact_inside(block):
            _, g0 = _grads(block, block, x, gy)
        on = [m for m in block.modules() if isinstance(m, ms.quant.QuantMixin)]
        assert on and all(m.enable for m in on), "exact_inside switches the layers back on"
        # their running ranges moved only in the unwrapped step (no quantization in the checkpoints)
        assert all(float(m.iteration) == 1 for m in block.modules() if isinstance(m, ms.LayerNorm))
    # the plain checkpoint recomputes exactly; the 8-bit input brings 8-bit error, no more
    assert max(rel_err(a, b) for a, b in zip(g_ck, g0)) <= 1e-6
    errs = [rel_err(a, b) for a, b in zip(g8, g0)]
    assert 1e-6 < max(errs) <= 1e-2, errs


def test_checkpoint_block_keeps_only_the_packed_input():
    torch.manual_seed(0)
    block = Block(64, 2).train()
    x = (torch.rand(4, 50, 64) * 2 - 1).requires_grad_()
    w8, w = CheckpointedBlock(block, bits=8), CheckpointedBlock(block, bits=None)
    with ms.SavedActivationMeter() as plain:
        block(x)
    kept = {}
    for wrapper in (w, w8):
        with ms.SavedActivationMeter() as meter:
            wrapper(x)
        # only what the checkpoint keeps is saved for backward (the meter sees it)
        kept[wrapper.bits] = sum(t.numel() * t.element_size() for t in wrapper.stored_inputs)
        assert kept[wrapper.bits] <= meter.total_bytes <= kept[wrapper.bits] + 64  # (storage padding)
    kept = kept[8]
    full = x.numel() * 4
    assert full // 4 <= kept <= full // 4 + 64  # 8-bit codes + 2 fp32 per group (2 groups of 32)
    assert w.stored_inputs[0] is x
    assert plain.total_bytes > 10 * kept


def test_four_bit_and_extra_arguments_pvt_block():
    """PVT's block(x, H, W): x packed at 4 bits, H and W passed on; gradients within 4-bit error."""
    torch.manual_seed(0)
    block = PVTBlock(64, 2, sr_ratio=2).train()
    x = torch.rand(2, 64, 64) * 2 - 1
    gy = torch.randn(2, 64, 64)
    y0, g0 = _grads(block, lambda t: block(t, 8, 8), x, gy)
    y4, g4 = _grads(block, lambda t: checkpoint_block(block, t, 8, 8, bits=4), x, gy)
    assert torch.equal(y4, y0)
    assert max(rel_err(a, b) for a, b in zip(g4, g0)) <= 0.2


def test_eval_and_no_grad_run_the_block_and_errors():
    block = Block(64, 2).eval()
    x = torch.rand(2, 5, 64)
    assert torch.equal(checkpoint_block(block, x, bits=8), block(x))
    with pytest.raises(TypeError, match="floating tensor"):
        checkpoint_block(Block(64, 2).train(), torch.ones(2, 5, 64, dtype=torch.long), bits=8)


@pytest.mark.parametrize("name", ["swin_tiny_patch4_window7_224", "pvt_tiny"])
def test_wrap_blocks_on_swin_and_pvt(name):
    """Blocks wrapped from outside (CheckpointedBlock has no with_cp of its own) run and train."""
    torch.manual_seed(0)
    kw = dict(img_size=32, window_size=4) if name.startswith("swin") else dict(img_size=32)
    m = models.create_model(name, num_classes=10, drop_path_rate=0., **kw).train()
    x = torch.rand(2, 3, 32, 32)
    y0 = m(x)
    wrapped = wrap_blocks(m, bits=8)
    assert wrapped and torch.equal(m(x), y0)
    m(x).sum().backward()
    assert all(p.grad is not None for p in m.parameters() if p.requires_grad)


def test_wrap_blocks_selection_on_a_model():
    torch.manual_seed(0)
    m = models.create_model("deit_tiny_patch16_224", img_size=32, depth=4, num_classes=10,
                            drop_path_rate=0.).train()
    x = torch.rand(2, 3, 32, 32)
    y0 = m(x)
    wrapped = wrap_blocks(m, bits=8, select=[1, 3])
    kinds = [type(b).__name__ for b in m.blocks]
    assert kinds == ["Block", "CheckpointedBlock", "Block", "CheckpointedBlock"]
    assert torch.equal(m(x), y0)
    m(x).sum().backward()
    assert all(p.grad is not None for p in m.parameters() if p.requires_grad)
    assert len(wrapped) == 2 and all(w.bits == 8 for w in wrapped)
    with pytest.raises(ValueError, match="out of range"):
        wrap_blocks(models.create_model("deit_tiny_patch16_224", img_size=32, depth=2), select=[5])


def test_checkpoint_selection_from_a_policy_file(tmp_path):
    """`on checkpoint:` in a policy file checkpoints the chosen blocks (here 1 and 3 with their
    input packed at 8 bits, 0 plainly): same forward, fewer saved bytes, state-dict keys
    unchanged; a key other than enable/bits or an index past the last block names file:line."""
    base = open("configs/mesa/mesa_8bit.txt", encoding="utf-8").read()
    pol = tmp_path / "mesa8_cckpt.txt"
    pol.write_text(base + "\non checkpoint:\n    by_index: 1 3\n    enable: True\n    bits: 8\n"
                   "    by_index: 0\n    enable: True\n")
    kw = dict(img_size=32, depth=4, num_classes=10, drop_path_rate=0.)
    torch.manual_seed(0)
    ref = models.create_model("deit_tiny_patch16_224", ms_policy="configs/mesa/mesa_8bit.txt",
                              **kw).train()
    torch.manual_seed(0)
    m = models.create_model("deit_tiny_patch16_224", ms_policy=str(pol), **kw).train()
    assert [getattr(b, "mesa_checkpoint", None) for b in m.blocks] == \
        [(True, None), (True, 8), None, (True, 8)]
    assert list(m.state_dict()) == list(ref.state_dict())
    x = torch.rand(2, 3, 32, 32)
    with ms.SavedActivationMeter() as full:
        y0 = ref(x)
    with ms.SavedActivationMeter() as part:
        y1 = m(x)
    assert torch.equal(y0, y1)
    assert part.total_bytes < 0.8 * full.total_bytes, (part.total_bytes, full.total_bytes)
    y1.sum().backward()
    assert all(p.grad is not None for p in m.parameters() if p.requires_grad)
    for extra, msg in (("    by_index: 0\n    ema_decay: 0.9\n", "takes only"),
                       ("    by_index: 9\n    enable: True\n", "out of range")):
        bad = tmp_path / "bad.txt"
        bad.write_text("on checkpoint:\n" + extra)
        with pytest.raises(ms.policy.PolicyError, match=rf"bad.txt:2: .*{msg}"):
            models.create_model("deit_tiny_patch16_224", ms_policy=str(bad), **kw)


def test_reentrant_checkpoint_updates_the_quantizers_once_as_without_checkpointing():
    """torch.utils.checkpoint(use_reentrant=True) (timm's checkpoint_seq, checkpoint_wrapper in
    REENTRANT mode) runs the forward under no_grad (no Mesa layer quantizes there) and
    recomputes it in backward: that recomputation updates the running ranges, once, so the
    quantizer state and gradients equal those of the step without checkpointing."""
    import torch.utils.checkpoint as C

    def make():
        torch.manual_seed(0)
        return models.create_model("deit_tiny_patch16_224", patch_size=8, depth=2, embed_dim=32, num_heads=2,
                                   img_size=32, num_classes=10, ms_policy="mesa8").train()

    x = torch.randn(4, 3, 32, 32)
    plain = make()
    plain(x).sum().backward()
    ck = make()
    for blk in ck.blocks:
        blk.forward = (lambda f: lambda *a: C.checkpoint(f, *a, use_reentrant=True))(blk.forward)
    ck(x.clone().requires_grad_()).sum().backward()
    sa, sb = plain.state_dict(), ck.state_dict()
    assert [k for k in sa if not torch.equal(sa[k], sb[k])] == []
    assert float(sb["blocks.0.norm1.iteration"]) == 1
    for (n, p), q in zip(plain.named_parameters(), ck.parameters()):
        assert torch.equal(p.grad, q.grad), n
