"""mesa_ops.audit: per-module saved tensors, packed or exact, and tools/audit.py."""
from __future__ import annotations

import torch
import torch.nn as nn

import mesa_ops as ms


class _Gate(nn.Module):
    def forward(self, x):
        return torch.sigmoid(x)  # saves its (B, 32) fp32 output exactly


def _model():
    m = nn.Sequential(ms.Linear(16, 32, enable=True), ms.GELU(enable=True), _Gate(), nn.Linear(32, 4))
    return m


def test_audit_attributes_and_classifies_saved_tensors():
    model = _model()
    x = torch.randn(8, 16)
    lines = []
    report = ms.audit(model, x, verbose=lines.append)
    rows = {r.name: r for r in report.modules}
    # Mesa Linear: uint8 codes (8 * 16 bytes) + its per-group step and shift (16 bytes per
    # group at most, in the codes' allocation or apart), all "compressed"
    assert rows["0"].packed_bytes == rows["0"].bytes
    assert any(t.dtype == "uint8" and 8 * 16 <= t.bytes <= 8 * 16 + 16 for t in rows["0"].tensors)
    assert 8 * 16 + 8 <= rows["0"].bytes <= 8 * 16 + 16
    assert rows["1"].packed_bytes == rows["1"].bytes and rows["1"].is_mesa
    # the sigmoid output and the plain Linear's input (the same storage: counted once, by the
    # first saver) are exact
    assert rows["2"].exact_bytes == 8 * 32 * 4 and rows["2"].packed_bytes == 0
    assert "3" not in rows
    assert report.exact_bytes == 8 * 32 * 4
    # totals agree with SavedActivationMeter (same de-duplication, parameters excluded)
    with ms.SavedActivationMeter(model) as meter:
        model(x)
    assert report.total_bytes == meter.total_bytes
    assert [u.name for u in report.uncompressed()] == ["2"]
    text = lines[0]
    assert "uncompressed remainder: 1.00 KiB" in text and "float32[8, 32]" in text
    assert model.training  # mode restored (it was training)
    model.eval()
    ms.audit(model, x, verbose=False)
    assert not model.training


def test_audit_exact_model_has_nothing_packed():
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    report = ms.audit(model, (torch.randn(8, 16),), verbose=False)
    assert report.packed_bytes == 0 and report.exact_bytes == report.total_bytes > 0


def test_audit_tool_prints_table(capsys):
    from tools.audit import main

    report = main(["--model", "vit_tiny_patch16_224", "--input-size", "32", "--batch-size", "2",
                   "--max-rows", "5"])
    out = capsys.readouterr().out
    assert "blocks.0.attn.sdpa" in out and "uncompressed remainder" in out
    assert report.packed_bytes > 0.5 * report.total_bytes
