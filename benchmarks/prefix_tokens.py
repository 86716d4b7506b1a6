"""Prefix tokens stored exactly or not (issue 22.8): gradient error against exact autograd and
saved bytes, per model and mode, with each model's ``prefix_tokens`` and with 0 (the class token
stored in the patch tokens' ranges).

    python -m benchmarks.prefix_tokens [--models deit_tiny_patch16_224 ...] [--img 224] [--batch 2]

Random-init weights, ranges warmed on ``--warm`` batches, then one batch: the relative error
``|g - g_exact| / |g_exact|`` of all parameter gradients (``all``) and of ``cls_token``'s, the
bytes saved for backward (``ms.SavedActivationMeter``). Modes: ``mesa8`` (the paper's policy),
``mesa8+cckpt8`` (also every block's input kept at 8 bits, compressed checkpointing).
"""
from __future__ import annotations

import argparse

import torch

import mesa_ops as ms

MiB = 2.0 ** 20
MODELS = ("deit_tiny_patch16_224", "deit_small_patch16_224", "pvt_tiny")
MODES = ("mesa8", "mesa8+cckpt8")


def _prefix_state(model) -> dict:
    return {id(q): q.prefix_tokens for q in model.modules() if isinstance(q, ms.QuantMixin)}


def _set_prefix(model, state: dict | None) -> None:
    for q in model.modules():
        if isinstance(q, ms.QuantMixin):
            q.prefix_tokens = 0 if state is None else state[id(q)]


def _step(model, x, y):
    """(flat parameter gradients, cls_token gradient, saved bytes) of one training step."""
    model.zero_grad(set_to_none=True)
    with ms.SavedActivationMeter(model) as meter:
        loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return grads, model.cls_token.grad.flatten().clone(), meter.total_bytes


def measure(name: str, mode: str, img: int = 224, batch: int = 2, warm: int = 3, seed: int = 0) -> dict:
    import models

    torch.manual_seed(seed)
    kw = dict(drop_path_rate=0.0, img_size=img)
    if mode.endswith("+cckpt8"):
        kw.update(grad_checkpointing=True, grad_checkpointing_bits=8)
    model = models.create_model(name, ms_policy="mesa8", **kw).train()
    state = _prefix_state(model)
    gen = torch.Generator().manual_seed(seed + 1)
    xs = [torch.randn(batch, 3, img, img, generator=gen) for _ in range(warm + 1)]
    ys = [torch.randint(0, 1000, (batch,), generator=gen) for _ in range(warm + 1)]
    out = {"model": name, "mode": mode}
    rng = ms.get_rng_state()
    for label, st in (("before", None), ("after", state)):
        ms.set_rng_state(rng)
        _set_prefix(model, st)
        for q in model.modules():  # the same warm-up for both
            if isinstance(q, ms.QuantMixin):
                q.iteration.zero_()
                q.clip_val.fill_(1.0)
                q.shift.zero_()
        torch.manual_seed(seed + 2)
        for x, y in zip(xs[:-1], ys[:-1]):
            _step(model, x, y)
        out[label] = _step(model, xs[-1], ys[-1])
    ms.policy.set_mesa(model, enable=False)
    ge, gc, be = _step(model, xs[-1], ys[-1])

    def err(a, b):
        return float((a - b).norm() / b.norm())
    for label in ("before", "after"):
        g, c, b = out.pop(label)
        out[label] = dict(err_all=err(g, ge), err_cls=err(c, gc), saved=b)
    out["exact_saved"] = be
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--img", type=int, default=224)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--warm", type=int, default=3)
    args = ap.parse_args(argv)
    print("| model | mode | grad error all: before -> after | cls_token grad error: before -> after "
          "| saved MiB: before -> after (Mesa off) |")
    print("|---|---|---|---|---|")
    for name in args.models:
        for mode in args.modes:
            r = measure(name, mode, args.img, args.batch, args.warm)
            b, a = r["before"], r["after"]
            print(f"| {name} | {mode} | {b['err_all']:.4f} -> {a['err_all']:.4f} | "
                  f"{b['err_cls']:.4f} -> {a['err_cls']:.4f} | {b['saved'] / MiB:.2f} -> "
                  f"{a['saved'] / MiB:.2f} ({r['exact_saved'] / MiB:.2f}, {a['saved'] / b['saved'] - 1:+.1%}) |",
                  flush=True)


if __name__ == "__main__":
    main()
