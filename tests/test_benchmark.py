"""benchmarks.models: modes, records, the batch search, the table and the plot (small, in-process)."""
import pytest
import torch

from benchmarks import models as B


@pytest.mark.parametrize("mode", B.MODES)
def test_measure_every_mode_on_a_small_deit(mode):
    cfg = B.Config("deit_tiny_patch16_224", mode, batch=2, input_size=32, steps=1, warmup=0,
                   num_classes=10)
    r = B.measure(cfg)
    assert r.mode == mode and r.saved_bytes > 0 and r.step_time_s > 0 and not r.oom
    exact = B.measure(B.Config("deit_tiny_patch16_224", "exact", 2, 32, steps=1, warmup=0,
                               num_classes=10))
    if mode.startswith("mesa8"):
        assert r.saved_bytes < 0.5 * exact.saved_bytes
    if mode == "exact-explicit":  # the N x N attention matrices are kept
        assert r.saved_bytes > exact.saved_bytes


def test_checkpoint_blocks_wraps_blocks_and_keeps_outputs():
    from models import create_model

    torch.manual_seed(0)
    m = create_model("deit_tiny_patch16_224", img_size=32, num_classes=10).train()
    x = torch.randn(2, 3, 32, 32)
    torch.manual_seed(1)
    y0 = m(x)
    wrapped = B.checkpoint_blocks(m)
    assert len(wrapped) == 12
    torch.manual_seed(1)
    assert torch.equal(m(x), y0)
    with pytest.raises(ValueError, match="no '\\*Block' modules"):
        B.checkpoint_blocks(torch.nn.Linear(2, 2))


def test_largest_batch_search_finds_the_boundary():
    calls = []

    def fake_worker(cfg):  # peak grows by 10 per sample over a base of 5
        calls.append(cfg.batch)
        return B.Record(cfg.model, cfg.mode, "fp32", cfg.batch, 224, "cpu", 0, 5 + 10 * cfg.batch, 0.0)

    cfg = B.Config("deit_tiny_patch16_224", "exact", 1)
    assert B.largest_batch(cfg, budget_bytes=405, worker=fake_worker) == 40
    assert B.largest_batch(cfg, budget_bytes=4, worker=fake_worker) == 0
    assert len(calls) < 20


def test_table_ratios_and_plot(tmp_path):
    recs = [B.Record("m", "exact", "fp32", 4, 224, "cpu", 400, 1000, 0.10),
            B.Record("m", "mesa8", "fp32", 4, 224, "cpu", 100, 500, 0.12)]
    table = B.markdown_table(recs, {("m", "exact"): 10, ("m", "mesa8"): 35})
    assert "| m | mesa8 | fp32 | 4 | 0.0 | 0.250 |" in table
    assert "| 35 | 3.50 |" in table
    pytest.importorskip("matplotlib")  # (last: the table is checked without it; the plot extra)
    out = tmp_path / "p.png"
    B.plot(recs, str(out))
    assert out.stat().st_size > 1000 and out.read_bytes()[:4] == b"\x89PNG"


def test_paper_table_pairs_exact_and_mesa8_with_the_paper_column():
    """Memory: each mode's peak MiB, Mesa / exact for the fused and the explicit attention, the
    paper's figures at batch 128 fp16; speed: img/s per mode. Missing modes are '-', OOM named."""
    from benchmarks.gpu import PAPER_MB, paper_table

    def rec(model, mode, batch, prec, mib, t, oom=False):
        return dict(model=model, mode=mode, batch=batch, precision=prec, peak_bytes=int(mib * 2**20),
                    step_time_s=t, oom=oom)
    rows = [rec("deit_tiny_patch16_224", "exact", 128, "fp16", 4000, 0.5),
            rec("deit_tiny_patch16_224", "exact-explicit", 128, "fp16", 5000, 0.64),
            rec("deit_tiny_patch16_224", "mesa8", 128, "fp16", 2000, 0.625),
            rec("deit_tiny_patch16_224", "mesa8-explicit", 128, "fp16", 2250, 0.8),
            rec("deit_tiny_patch16_224", "exact", 64, "bf16", 2000, 0.25),
            rec("deit_tiny_patch16_224", "mesa8", 64, "bf16", 0, float("nan"), oom=True),
            rec("pvt_tiny", "mesa8", 128, "fp16", 100, 0.1)]  # (no exact row: left out)
    mem, speed = paper_table(rows).split("\n\n")
    assert len(mem.splitlines()) == 4 and len(speed.splitlines()) == 4

    def cells(table, batch):
        line = next(x for x in table.splitlines() if f"| {batch} |" in x)
        return [c.strip() for c in line.strip("|").split("|")]
    c = cells(mem, 128)
    assert c[3:9] == ["4000", "5000", "2000", "2250", "0.500", "0.450"]
    assert c[9:] == [str(PAPER_MB["deit_tiny_patch16_224"][0]), str(PAPER_MB["deit_tiny_patch16_224"][1]),
                     "0.445"]
    assert cells(speed, 128)[3:] == ["256", "200", "205", "160", "0.800", "0.800"]
    c = cells(mem, 64)
    assert c[3:9] == ["2000", "-", "OOM", "-", "-", "-"] and c[9:] == ["-", "-", "-"]


def test_sdpa_backward_benchmark_bytes_and_table():
    """benchmarks.sdpa_backward (issue 20): the default (union, auto backward) stores what the
    paper's configuration stores (the forward's logsumexp); the consistent backward stores less
    (no logsumexp); the table has a row per configuration."""
    from benchmarks import sdpa_backward as S

    rows = S.measure("deit_tiny_patch16_224", img=32, batch=2, rounds=1)
    by = {r["config"]: r for r in rows}
    assert set(by) == {"paper", "default", "consistent"}
    assert by["paper"]["saved_x"] == 1.0 and by["default"]["saved_x"] == 1.0
    lse = 12 * 2 * 3 * 5 * 4 / 2 ** 20  # 12 blocks, (B, H, N) fp32, N = 4 patches + the class token
    assert by["consistent"]["saved_mib"] == pytest.approx(by["paper"]["saved_mib"] - lse, abs=1e-9)
    table = S.format_table(rows, 1)
    assert table.count("| deit_tiny_patch16_224 |") == 3 and "| default | union | None |" in table


def test_roofline_rows_bytes_and_fractions(capsys):
    """benchmarks.roofline (issue 36): each kernel's minimum bytes follow from n, the element size
    and the bits; the fractions are of the copy's bandwidth; the CLI prints the table."""
    from benchmarks import roofline

    rows = roofline.measure((2, 17, 64), groups=2, bits=4, repeats=2)
    n = 2 * 17 * 64
    assert [r["kernel"] for r in rows] == ["quantize", "dequantize", "table x grad", "copy"]
    assert [r["bytes"] for r in rows] == [4 * n + n // 2, n // 2 + 4 * n, n // 2 + 8 * n, 8 * n]
    assert all(r["seconds"] > 0 and r["gbps"] > 0 for r in rows) and rows[-1]["of_copy"] == 1.0
    roofline.main(["--device", "cpu", "--shape", "2", "17", "64", "--groups", "2", "--repeats", "2"])
    out = capsys.readouterr().out
    assert "| dequantize | 2,176 |" in out and "float32, 2 groups, 8 bits" in out
    with pytest.raises(SystemExit):
        roofline.main(["--device", "cpu", "--shape", "2", "17", "64", "--groups", "3"])


def test_host_time_rows_and_the_whole_step_count(capsys):
    """benchmarks.host_time: a row per layer with every figure timed, and the whole-step row of
    DeiT-Ti at 32 x 32, whose Mesa step stores 86 activations (per block 2 LayerNorms, q / k / v /
    output of the SDPA and the GELU's input; the final norm and the head's input)."""
    from benchmarks import host_time

    rows = host_time.measure(20)
    assert [r["layer"] for r in rows] == ["Linear 192->192", "LayerNorm 192", "GELU"]
    assert all(r[k] > 0 for r in rows for k in r if k != "layer")
    r = host_time.measure_model("deit_tiny_patch16_224", steps=2, warmup=1)
    assert r["stored"] == 12 * 7 + 2 and r["exact"] > 0 and r["mesa8"] > 0
    assert "86 stored activations" in host_time.model_line(r)
