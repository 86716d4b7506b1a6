"""Peak memory per rank, DDP vs FSDP2, exact vs Mesa 8-bit vs Mesa 8-bit + compressed
checkpointing: 2 gloo processes on CPU, a few AdamW steps each, a fresh pair of processes per case.

    python -m benchmarks.fsdp_memory [--model deit_small_patch16_224 ...] [--img 112] [--batch 8]
                                     [--budget-mib 1024]

Prints per model, case and rank 0: peak RSS (``ru_maxrss``, the whole process: torch itself
included), the local model state (parameters + gradients + AdamW moments, local shards under
FSDP2), the bytes saved for backward in a training forward (``ms.SavedActivationMeter``), and the
largest batch per rank whose model state + saved activations fit ``--budget-mib`` (saved
activations grow linearly with the batch: measured at ``--batch``, scaled; 0 where the model
state alone is over the budget).
"""
from __future__ import annotations

import argparse
import os
import resource
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MiB = 2.0 ** 20
CASES = [(w, m) for w in ("ddp", "fsdp") for m in ("exact", "mesa8", "mesa8+ckpt8")]


def _local_bytes(t) -> int:
    from torch.distributed.tensor import DTensor
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def _worker(rank, world, store, args, wrapper, mode, out):
    import mesa_ops as ms
    import mesa_ops.checkpoint
    import models
    from training import fsdp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = models.create_model(args.model, img_size=args.img, num_classes=100)
    if mode != "exact":
        models.apply_policy(model, "mesa8", verbose=lambda *_: None)
    if mode.endswith("ckpt8"):
        mesa_ops.checkpoint.wrap_blocks(model, bits=8)
    model.train()
    if wrapper == "fsdp":
        model = fsdp.wrap(model, torch.device("cpu"))
        bare = model
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
        bare = model.module
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, 3, args.img, args.img)
    y = torch.randint(0, 100, (args.batch,))
    saved = 0
    for i in range(args.steps):
        meter = ms.SavedActivationMeter(bare)
        with meter:
            loss = torch.nn.functional.cross_entropy(model(x), y)
        saved = meter.total_bytes if i == 0 else saved
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
    state = sum(_local_bytes(p) * 2 for p in model.parameters()) + sum(
        _local_bytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux
    if rank == 0:
        torch.save({"peak_mib": peak, "state_mib": state / MiB, "saved_mib": saved / MiB}, out)
    dist.barrier()
    dist.destroy_process_group()


def largest_batch(budget_mib: float, state_mib: float, saved_mib: float, batch: int) -> int:
    """The largest per-rank batch whose model state + saved activations fit ``budget_mib``, with
    the saved activations ``saved_mib`` at ``batch`` scaled linearly."""
    per_sample = saved_mib / batch
    return max(0, int((budget_mib - state_mib) // per_sample)) if per_sample > 0 else 0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", nargs="+", default=["deit_small_patch16_224"])
    p.add_argument("--img", type=int, default=112)
    p.add_argument("--batch", type=int, default=8, help="per rank")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--budget-mib", type=float, default=1024.0,
                   help="per-rank budget for model state + saved activations")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"{args.img} px, batch {args.batch} per rank, 2 gloo ranks, {args.steps} AdamW steps; largest "
          f"batch: model state + saved activations within {args.budget_mib:.0f} MiB per rank")
    print("| model | wrap | activations | peak RSS rank 0 (MiB) | model state (MiB) | saved for backward "
          "(MiB) | largest batch |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.model:
            margs = argparse.Namespace(**{**vars(args), "model": model})
            for i, (wrapper, mode) in enumerate(CASES):
                out = os.path.join(tmp, f"{model}{i}.pth")
                mp.spawn(_worker, args=(2, os.path.join(tmp, f"store{model}{i}"), margs, wrapper, mode, out),
                         nprocs=2)
                r = torch.load(out, weights_only=True)
                big = largest_batch(args.budget_mib, r["state_mib"], r["saved_mib"], args.batch)
                print(f"| {model} | {wrapper} | {mode} | {r['peak_mib']:.0f} | {r['state_mib']:.1f} | "
                      f"{r['saved_mib']:.1f} | {big} |", flush=True)


if __name__ == "__main__":
    main()
