"""Plan per-layer Mesa bits and per-block checkpointing for a saved-activation budget.

    .venv/bin/python tools/plan_memory.py --model deit_small_patch16_224 --input-size 224 \
        --batch-size 64 --budget-gb 2 --out plan.txt

Measures the model at ``--probe-batch`` (bytes scaled linearly to ``--batch-size``; see
``mesa_ops.planner`` for what is measured and what is estimated), plans, writes ``--out``: one
policy file with the bits per layer and an ``on checkpoint:`` section (the checkpointed blocks),
which ``tools/train.py --ms-plan`` (or ``--ms-policy``), ``models.create_model(ms_policy=out)`` and
``mesa_ops.planner.apply_plan`` apply; then measures the planned configuration. For a model of
tools/train.py pass the same ``--model-kwargs`` and ``--num-classes``. Exits with status 2 and
the reason when no configuration fits the budget.
"""
from __future__ import annotations

import argparse
import sys

import torch
from timm.utils import ParseKwargs

import models  # noqa: F401  (registers this repo's models with timm as mesa_<name>)
from mesa_ops import planner as P
from mesa_ops.bench import build_model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="this repo's model, a timm model, or timm:<name>")
    ap.add_argument("--input-size", type=int, default=224)
    ap.add_argument("--model-kwargs", nargs="*", default={}, action=ParseKwargs, metavar="KEY=VALUE",
                    help="model constructor arguments, as tools/train.py's (e.g. depth=4 embed_dim=96)")
    ap.add_argument("--num-classes", type=int, default=None, help="classifier size (default: the model's)")
    ap.add_argument("--batch-size", type=int, required=True)
    ap.add_argument("--budget-gb", type=float, required=True, 
                    help="saved-activation budget, 1 GB = 1e9 bytes")
    ap.add_argument("--probe-batch", type=int, default=None, help="batch measured (default: min(batch, 2))")
    ap.add_argument("--verify-batch", type=int, default=None,
                    help="batch at which the planned configuration is measured (default: --batch-size; "
                         "bytes are scaled linearly when smaller)")
    ap.add_argument("--out", default=None, help="write the plan here (one policy file)")
    ap.add_argument("--no-checkpoint", action="store_true", help="choose bits only (no block checkpointing)")
    ap.add_argument("--objective", choices=P.OBJECTIVES, default="error",
                    help="error: the least error proxy that fits, then the least time (default); time: the "
                         "fastest that fits by the measured estimate (bits per layer, plain or packed "
                         "checkpointing per block), of plans within 2%% of the exact step the least error")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    kw = dict(args.model_kwargs or {})
    if args.num_classes is not None:
        kw["num_classes"] = args.num_classes
    model = build_model(args.model, "off", img_size=args.input_size, **kw)
    s = args.input_size
    probe = torch.randn(args.probe_batch or min(args.batch_size, 2), 3, s, s)
    prof = P.measure(model, probe)
    try:
        plan = P.make_plan(prof, int(args.budget_gb * 1e9), args.batch_size,
                           checkpointing=not args.no_checkpoint, objective=args.objective)
    except P.PlanError as exc:
        print(f"plan_memory: {exc}", file=sys.stderr)
        sys.exit(2)
    vb = args.verify_batch or args.batch_size
    got = P.verify(model, plan, torch.randn(vb, 3, s, s), grad_error=vb <= 8)
    print(P.summary(plan, prof, header=f"{args.model}, {s} px"))
    if args.out:
        P.write_plan(plan, model, args.out, header=f"{args.model}, {s} px")
        print(f"wrote {args.out} (tools/train.py --ms-plan {args.out})")
    return plan, got


if __name__ == "__main__":
    main()
