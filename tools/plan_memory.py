"""Plan per-layer Mesa bits and per-block checkpointing for a saved-activation budget.

    .venv/bin/python tools/plan_memory.py --model deit_small_patch16_224 --input-size 224 \
        --batch-size 64 --budget-gb 2 --out plan.txt

Measures the model at ``--probe-batch`` (bytes scaled linearly to ``--batch-size``; see
``mesa_ops.planner`` for what is measured and what is estimated), plans, writes ``--out`` (a
policy file for ``--ms-policy`` / ``ms.policy.deploy_on_init``: the bits) and ``--out``.json (the
whole plan, with the checkpointed blocks: ``mesa_ops.planner.apply_plan(model, out)`` applies
both), then measures the planned configuration. Exits with status 2 and the reason when no
configuration fits the budget.
"""
from __future__ import annotations

import argparse
import sys

import torch

import models  # noqa: F401  (registers this repo's models with timm as mesa_<name>)
from mesa_ops import planner as P
from mesa_ops.compress import build_model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="this repo's model, a timm model, or timm:<name>")
    ap.add_argument("--input-size", type=int, default=224)
    ap.add_argument("--batch-size", type=int, required=True)
    ap.add_argument("--budget-gb", type=float, required=True, 
                    help="saved-activation budget, 1 GB = 1e9 bytes")
    ap.add_argument("--probe-batch", type=int, default=None, help="batch measured (default: min(batch, 2))")
    ap.add_argument("--verify-batch", type=int, default=None,
                    help="batch at which the planned configuration is measured (default: --batch-size; "
                         "bytes are scaled linearly when smaller)")
    ap.add_argument("--out", default=None, help="write the policy file here (and <out>.json)")
    ap.add_argument("--no-checkpoint", action="store_true", help="choose bits only (no block checkpointing)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    model = build_model(args.model, "off", img_size=args.input_size)
    s = args.input_size
    probe = torch.randn(args.probe_batch or min(args.batch_size, 2), 3, s, s)
    prof = P.measure(model, probe)
    try:
        plan = P.make_plan(prof, int(args.budget_gb * 1e9), args.batch_size,
                           checkpointing=not args.no_checkpoint)
    except P.PlanError as exc:
        print(f"plan_memory: {exc}", file=sys.stderr)
        sys.exit(2)
    vb = args.verify_batch or args.batch_size
    got = P.verify(model, plan, torch.randn(vb, 3, s, s), grad_error=vb <= 8)
    print(P.summary(plan, prof, header=f"{args.model}, {s} px"))
    if args.out:
        P.write_plan(plan, model, args.out, header=f"{args.model}, {s} px")
        print(f"wrote {args.out} and {args.out}.json")
    return plan, got


if __name__ == "__main__":
    main()
