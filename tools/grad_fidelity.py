"""Gradient bias and noise of Mesa policies on a model, against exact autograd.

    .venv/bin/python tools/grad_fidelity.py --model deit_tiny_patch16_224 --batch-size 4 \
        --policy mesa8 mesa4 mesa2 --draws 16 --json fidelity.json
    .venv/bin/python tools/grad_fidelity.py --model demo --data-set DIGITS --range-mode ema union

For each policy (x range mode): a fresh model with the same weights (``--weights``, else random
init from ``--seed``), ``--warm-steps`` training forwards on further batches (the running
ranges' warm-up), then ``--draws`` stochastic-rounding draws of the gradient of one fixed batch
against the exact gradient; prints per parameter group the single-draw error, the error of the
mean of k draws (its floor is the bias), the bias estimate and the noise, in % of the exact
gradient's norm (see ``mesa_ops.fidelity``). ``--model demo`` is the small DeiT of
``scripts/demo.sh`` (32 px, DIGITS by default).
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from timm.utils import ParseKwargs

import data
import mesa_ops as ms
import models
from mesa_ops import fidelity
from mesa_ops.bench import build_model
from mesa_ops.reference import RANGE_MODES


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True,
                    help="'demo', this repo's model (models.list_models()), a timm model or timm:<name>")
    ap.add_argument("--model-kwargs", nargs="*", default={}, action=ParseKwargs, metavar="KEY=VALUE",
                    help="extra constructor arguments, e.g. attn_impl=explicit depth=4")
    ap.add_argument("--weights", default=None, help="a checkpoint to load (else random init from --seed)")
    ap.add_argument("--policy", nargs="+", default=["mesa8", "mesa4", "mesa2"],
                    help="'mesa8' / 'mesa4' / 'mesa2' or policy files (default: the three)")
    ap.add_argument("--range-mode", nargs="+", default=[None], choices=RANGE_MODES,
                    help="range rule(s) to compare (default: the quantizers' own, 'union')")
    ap.add_argument("--data-set", default=None, help="DIGITS, FAKE, CIFAR100, IMNET (validation images) "
                    "or 'random' (N(0,1) images, random labels; default, 'DIGITS' for --model demo)")
    ap.add_argument("--data-path", default=None)
    ap.add_argument("--input-size", type=int, default=None, help="default 224 (32 for --model demo)")
    ap.add_argument("--num-classes", type=int, default=None,
                    help="default: the data set's (random: the model's own)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--warm-steps", type=int, default=5, help="training forwards before the draws")
    ap.add_argument("--draws", type=int, default=16)
    ap.add_argument("--groups", type=int, default=None, help="print at most this many groups per table")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sdpa-backward", choices=("auto", "consistent", "lse"), default="auto",
                    help="fused attention backward: 'consistent' (reruns the forward on the stored "
                    "q, k, v), 'lse' (the forward's softmax statistics) or 'auto' (the default: "
                    "consistent below 8 bits or under range_mode 'ema'; ms.SDPA.consistent_backward)")
    ap.add_argument("--json", default=None, help="write the reports here")
    args = ap.parse_args(argv)
    if args.batch_size < 1 or args.warm_steps < 0 or args.draws < 2:
        ap.error("--batch-size must be >= 1, --warm-steps >= 0 and --draws >= 2")
    if args.model == models.demo.DEMO_NAME:
        args.model = models.demo.DEMO_MODEL
        args.model_kwargs = {**models.demo.DEMO_KWARGS, **args.model_kwargs}
        args.input_size = args.input_size or models.demo.DEMO_INPUT_SIZE
        args.data_set = args.data_set or "DIGITS"
    args.input_size = args.input_size or 224
    args.data_set = args.data_set or "random"
    return args


def _batches(args, n: int):
    """``n`` batches (x (B, 3, S, S), labels (B,)) and the number of classes (None: random)."""
    g = torch.Generator().manual_seed(args.seed)
    b, s = args.batch_size, args.input_size
    if args.data_set.lower() == "random":
        k = args.num_classes or 1000
        return [(torch.randn(b, 3, s, s, generator=g), torch.randint(0, k, (b,), generator=g))
                for _ in range(n)], args.num_classes
    ns = argparse.Namespace(data_set=args.data_set, data_path=args.data_path, input_size=s,
                            eval_crop_ratio=0.875, fake_size=max(64, 4 * n * b))
    ds, num_classes = data.build_dataset(False, ns)
    if len(ds) < n * b:
        raise SystemExit(f"grad_fidelity: {args.data_set} has {len(ds)} images, {n * b} needed")
    idx = torch.randperm(len(ds), generator=g)[:n * b].tolist()
    items = [ds[i] for i in idx]
    xs = torch.stack([im for im, _ in items])
    ys = torch.tensor([int(t) for _, t in items])
    return list(zip(xs.split(b), ys.split(b))), args.num_classes or num_classes


def _finite(obj):
    """``obj`` with NaN floats as None (strict JSON)."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return None if isinstance(obj, float) and obj != obj else obj


def main(argv=None):
    args = _args(argv)
    batches, num_classes = _batches(args, 1 + args.warm_steps)
    kw = dict(args.model_kwargs, **({"num_classes": num_classes} if num_classes else {}))

    def build(policy):
        if policy not in ("off", "mesa8", "mesa4", "mesa2") and not os.path.isfile(policy):
            raise SystemExit(f"grad_fidelity: --policy {policy}: neither mesa8/mesa4/mesa2 nor a file")
        model = build_model(args.model, policy, img_size=args.input_size, **kw)
        for m in model.modules():
            if isinstance(m, ms.SDPA):
                m.consistent_backward = {"auto": None, "consistent": True, "lse": False}[args.sdpa_backward]
        return model

    torch.manual_seed(args.seed)
    base = build("off")
    if args.weights:
        models.load_checkpoint(base, args.weights, verbose=print)
    (x, y), warm = batches[0], batches[1:]
    reports = fidelity.compare(build, args.policy, args.range_mode, x, y, warm=warm,
                               state_dict=base.state_dict(), draws=args.draws)
    for rep in reports:
        rep.update(model=args.model, model_kwargs=args.model_kwargs, input_size=args.input_size,
                   sdpa_backward=args.sdpa_backward,
                   data_set=args.data_set, batch_size=args.batch_size, weights=args.weights,
                   seed=args.seed)
        title = (f"{args.model} {args.input_size} px, {rep['policy']}, range_mode {rep['range_mode']}, "
                 f"batch {args.batch_size} of {args.data_set}, {rep['warm_steps']} warm-up steps, "
                 f"{rep['draws']} draws, SDPA backward {args.sdpa_backward} (% of the exact gradient's norm):")
        print(fidelity.format_table(rep, title, max_groups=args.groups))
        print()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(_finite(reports), f, indent=1)
        print(f"wrote {args.json}")
    return reports


if __name__ == "__main__":
    main()
