"""Models from the other zoos (torchvision, Hugging Face transformers) under ``ms.compress``:
saved bytes vs exact, what stays exact, and Mesa's gradient error against minibatch noise
(issue 49). Small random-init configurations of each architecture (2 blocks; ViTs at width 384
with 6 heads, timm's ``vit_small`` shape), so a row takes seconds on a CPU.

    .venv/bin/python -m benchmarks.zoo            # the table of docs/compress.md
"""
from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F

import mesa_ops as ms

IMG, PATCH, WIDTH, HEADS, DEPTH, BATCH = 64, 8, 384, 6, 2, 4
SEQ, VOCAB = 64, 1000


def _timm(name, **kw):
    import timm

    return timm.create_model(name, num_classes=10, **kw)


def _tv_vit():
    from torchvision.models import VisionTransformer

    return VisionTransformer(image_size=IMG, patch_size=PATCH, num_layers=DEPTH, num_heads=HEADS,
                             hidden_dim=WIDTH, mlp_dim=4 * WIDTH, num_classes=10)


def _tv_swin(v2: bool):
    from torchvision.models import swin_transformer as S

    extra = dict(block=S.SwinTransformerBlockV2, downsample_layer=S.PatchMergingV2) if v2 else {}
    return S.SwinTransformer(patch_size=[4, 4], embed_dim=96, depths=[2, 2], num_heads=[3, 6],
                             window_size=[4, 4], num_classes=10, **extra)


def _hf(kind: str):
    import transformers as T

    vit = dict(hidden_size=WIDTH, num_hidden_layers=DEPTH, num_attention_heads=HEADS,
               intermediate_size=4 * WIDTH, image_size=IMG, patch_size=PATCH, num_labels=10)
    if kind == "vit":
        return T.ViTForImageClassification(T.ViTConfig(**vit))
    if kind == "deit":
        return T.DeiTForImageClassification(T.DeiTConfig(**vit))
    if kind == "dinov2":
        return T.Dinov2ForImageClassification(T.Dinov2Config(**vit))
    if kind == "beit":
        return T.BeitForImageClassification(T.BeitConfig(**vit, use_relative_position_bias=True))
    if kind == "swin":
        return T.SwinForImageClassification(T.SwinConfig(image_size=IMG, patch_size=4, embed_dim=96,
                                                         depths=[2, 2], num_heads=[3, 6], window_size=4,
                                                         num_labels=10))
    if kind == "bert":
        return T.BertForSequenceClassification(T.BertConfig(
            vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=DEPTH, num_attention_heads=HEADS,
            intermediate_size=4 * WIDTH, max_position_embeddings=SEQ, num_labels=10))
    if kind == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=WIDTH, n_layer=DEPTH, n_head=HEADS,
                                              n_positions=SEQ, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1))
    raise ValueError(kind)


# name -> (builder, input kind); 'image': (B, 3, IMG, IMG), 'tokens': (B, SEQ) ids
MODELS = {
    "timm vit_small": (lambda: _timm("vit_small_patch16_224", img_size=IMG, patch_size=PATCH, depth=DEPTH),
                       "image"),
    "timm swin_tiny": (lambda: _timm("swin_tiny_patch4_window7_224", img_size=IMG, window_size=4,
                                     depths=(2, 2), num_heads=(3, 6)), "image"),
    "torchvision vit_b_16": (_tv_vit, "image"),
    "torchvision swin_t": (lambda: _tv_swin(False), "image"),
    "torchvision swin_v2_t": (lambda: _tv_swin(True), "image"),
    "HF ViT": (lambda: _hf("vit"), "image"),
    "HF DeiT": (lambda: _hf("deit"), "image"),
    "HF Dinov2": (lambda: _hf("dinov2"), "image"),
    "HF BEiT": (lambda: _hf("beit"), "image"),
    "HF Swin": (lambda: _hf("swin"), "image"),
    "HF BERT": (lambda: _hf("bert"), "tokens"),
    "HF GPT-2": (lambda: _hf("gpt2"), "tokens"),
}


def example(kind: str, batch: int = BATCH, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if kind == "image":
        return torch.randn(batch, 3, IMG, IMG, generator=g)
    return torch.randint(0, VOCAB, (batch, SEQ), generator=g)


def build(name: str, seed: int = 0):
    """(the model in training mode, its input kind)."""
    builder, kind = MODELS[name]
    torch.manual_seed(seed)
    return builder().train(), kind


def logits(out):
    """The logits of a model's output (a tensor, a tuple, a dict or a ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) or hasattr(out, "logits"):
        return out["logits"]
    return out[0]


def loss(out) -> torch.Tensor:
    """Cross-entropy of a model's logits (B, classes) or (B, N, vocab) against fixed random labels."""
    z = logits(out).float()
    z = z.reshape(-1, z.shape[-1])
    labels = torch.randint(0, z.shape[-1], (z.shape[0],), generator=torch.Generator().manual_seed(3))
    return F.cross_entropy(z, labels)


def saved_bytes(model, x) -> int:
    with ms.SavedActivationMeter(model) as meter:
        out = model(x)
    loss(out).backward()
    model.zero_grad(set_to_none=True)
    return meter.total_bytes


def measure(name: str, policy: str = "mesa8") -> dict:
    """Saved bytes (one training forward, batch :data:`BATCH`) exact vs Mesa, the compress
    report and the forward's equality."""
    ref, kind = build(name)
    x = example(kind)
    mesa, report = ms.compress(copy.deepcopy(ref), policy, example_inputs=x, return_report=True,
                               warn=False)
    ys, grads = [], []
    for model in (ref, mesa.train()):
        torch.manual_seed(1)  # (the same dropout / stochastic-depth draws)
        out = model(x)
        ys.append(logits(out))
        loss(out).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        model.zero_grad(set_to_none=True)
    exact, packed = saved_bytes(ref, x), saved_bytes(mesa, x)
    err = float((grads[1] - grads[0]).norm() / grads[0].norm())
    check = ms.verify(mesa, example(kind, 2 * BATCH, seed=1), loss_fn=loss, draws=2)
    return {"model": name, "exact": exact, "mesa": packed, "ratio": packed / exact, "grad_error": err,
            "same_forward": bool(torch.equal(ys[0], ys[1])), "report": report, "verify": check,
            "attention": len(report.attention), "left": report.unsupported}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--policy", default="mesa8")
    args = ap.parse_args(argv)
    print(f"# {args.policy}, batch {BATCH}, images {IMG} px, token sequences {SEQ}, random init, "
          f"{DEPTH} blocks, each model's default dropout; gradient error: |g_mesa - g_exact| / |g_exact| "
          f"(cross-entropy, random labels); verify: ms.verify on {2 * BATCH} other samples, 2 draws, "
          "flagged above 0.5x")
    print("| model | saved exact MiB | saved Mesa MiB | ratio | attention converted | forward equal "
          "| gradient error | verify: worst error / minibatch noise | flagged | left exact |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name in args.models:
        r = measure(name, args.policy)
        rows.append(r)
        left = "; ".join(sorted({f"{c.rsplit('.', 1)[-1]}" for _, c, _ in r["left"]})) or "-"
        v = r["verify"]
        worst = max(v.vs_noise.items(), key=lambda kv: kv[1])
        print(f"| {name} | {r['exact'] / 2**20:.2f} | {r['mesa'] / 2**20:.2f} | {r['ratio']:.3f} | "
              f"{r['attention']} | {'yes' if r['same_forward'] else 'no'} | {r['grad_error']:.2%} | "
              f"{worst[1]:.2f}x ({worst[0]}) | {len(v.flagged)} | {left} |",
              flush=True)
    return rows


if __name__ == "__main__":
    main()
