"""Issue 25: the same Mesa command at the same seed gives the same result whatever the thread count.

Mesa's stochastic rounding is a discontinuous function of the activations: a last-bit difference
upstream flips a few codes, each a whole quantization step, and two runs drift apart within an
epoch. The forward ops of PyTorch's CPU kernels give the same bits for any thread count; two
backward reductions did not and are done here in an order that does not depend on it: the
LayerNorm weight / bias gradients (aten's kernel sums per-thread partials) and the weight
gradient of a Linear with few outputs (the BLAS splits a thin g^T x across threads)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

import mesa_ops as ms

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _grads(make, x, g, nthreads):
    torch.set_num_threads(nthreads)
    torch.manual_seed(0)
    layer = make().train()
    layer.layer_name = "layer"  # (named: an unnamed layer's stream is salted by its construction number)
    xi = x.clone().requires_grad_()
    layer(xi).backward(g)
    return [xi.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("kind", ["layernorm", "head"])
def test_layer_gradients_do_not_depend_on_the_thread_count(threads, kind):
    """Bit for bit with 1 and 2 threads: the shapes where aten's LayerNorm backward and a thin
    g^T x product gave other last bits (544 x 64 tokens; a 10-class head)."""
    gen = torch.Generator().manual_seed(0)
    if kind == "layernorm":
        def make():
            return ms.LayerNorm(64, quant_groups=2, enable=True)
        x, g = torch.randn(32, 17, 64, generator=gen), torch.randn(32, 17, 64, generator=gen)
    else:
        def make():
            return ms.Linear(64, 10, quant_groups=2, enable=True)
        x, g = torch.randn(544, 64, generator=gen), torch.randn(544, 10, generator=gen)
    one, two = _grads(make, x, g, 1), _grads(make, x, g, 2)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def _train(tmp_path, nthreads: int) -> tuple[list[str], dict]:
    out = tmp_path / f"t{nthreads}"
    env = dict(os.environ, OMP_NUM_THREADS=str(nthreads))
    argv = [sys.executable, str(ROOT / "tools" / "train.py"), "--model", "deit_tiny_patch16_224",
            "--model-kwargs", "patch_size=8", "depth=2", "embed_dim=64", "num_heads=2",
            "--data-set", "DIGITS", "--batch-size", "64", "--epochs", "2", "--unscale-lr", "--lr", "5e-3",
            "--warmup-epochs", "1", "--aa", "none", "--color-jitter", "0", "--reprob", "0",
            "--mixup", "0", "--cutmix", "0", "--drop-path", "0", "--no-model-ema", "--num-workers", "0",
            "--ms-policy", str(ROOT / "configs" / "mesa" / "mesa_8bit.txt"), "--print-freq", "5",
            "--device", "cpu", "--output-dir", str(out)]
    p = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    losses = [ln.split("loss:")[1].split("img/s")[0].strip() for ln in p.stdout.splitlines()
              if ln.startswith("Epoch:") and "loss:" in ln]
    accs = [ln for ln in p.stdout.splitlines() if ln.startswith("* Acc@1")]
    state = torch.load(out / "checkpoint.pth", map_location="cpu", weights_only=True)["model"]
    return losses + accs, state


def test_mesa_digits_run_is_the_same_with_one_and_two_threads(tmp_path):
    """Two Mesa 8-bit DIGITS runs (2 epochs, 24 steps each) in separate processes, one with one
    thread and one with two: the same losses and accuracies printed, the same weights and
    quantizer state bit for bit."""
    log1, s1 = _train(tmp_path, 1)
    log2, s2 = _train(tmp_path, 2)
    assert len(log1) >= 6 and log1 == log2
    assert s1.keys() == s2.keys()
    assert any(k.endswith("clip_val") for k in s1)
    diff = [k for k in s1 if not torch.equal(s1[k], s2[k])]
    assert not diff, diff


@pytest.mark.parametrize("shape,normalized", [((8,), 8), ((4, 8), (4, 8))])
def test_layernorm_of_an_unbatched_input(shape, normalized):
    """normalized_shape covering the whole input: no rows to sum over (aten's kernel)."""
    ln = ms.LayerNorm(normalized, quant_groups=1, enable=True).train()
    ref = torch.nn.LayerNorm(normalized)
    x = torch.randn(shape)
    for layer in (ln, ref):
        layer(x.clone().requires_grad_()).pow(2).sum().backward()
    assert ln.weight.grad.shape == ref.weight.grad.shape
    torch.testing.assert_close(ln.bias.grad, ref.bias.grad, rtol=0.05, atol=0.05)
