"""What autograd saves for backward in one training step, per module, and whether Mesa packed it.

    .venv/bin/python tools/audit.py --model vit_small_patch16_224 --policy mesa8 \
        --input-size 224 --batch-size 2 [--verify [--leave-exact]]

``--model``: this repo's models (``models.list_models()``), any timm model (converted by
``mesa_ops.compress``), or ``timm:<name>`` for timm's model of a name this repo also has.
"""
from __future__ import annotations

import argparse

import torch

import mesa_ops as ms
from mesa_ops.bench import build_model
import models  # noqa: F401  (registers this repo's models with timm as mesa_<name>)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--policy", default="mesa8", help="mesa8 / mesa4 / mesa2 / off or a policy file")
    ap.add_argument("--input-size", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--max-rows", type=int, default=None, help="print at most this many modules")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verify", action="store_true",
                    help="also check Mesa's gradients on the batch against exact ones (mesa_ops.verify)")
    ap.add_argument("--threshold", type=float, default=0.05, help="--verify: flag errors above this")
    ap.add_argument("--draws", type=int, default=3, help="--verify: Mesa passes")
    ap.add_argument("--leave-exact", action="store_true",
                    help="--verify: switch the layers causing flagged errors to exact and check again")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    model = build_model(args.model, args.policy, img_size=args.input_size)
    x = torch.randn(args.batch_size, 3, args.input_size, args.input_size)
    print(f"# {args.model}, policy {args.policy}, batch {args.batch_size}, {args.input_size} px, "
          f"one training forward (fp32, {x.device})")
    report = ms.audit(model, x, max_rows=args.max_rows)
    if args.verify:
        print(ms.verify(model, x, draws=args.draws, threshold=args.threshold,
                        leave_exact=args.leave_exact).summary())
    return report


if __name__ == "__main__":
    main()
